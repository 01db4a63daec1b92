"""The rank side of the localiser: what every operation of a traced step produced, seen through torch.

`StepTracer` watches a rank train from the outside: a ``TorchDispatchMode`` sees every aten op and
collective the process runs (whatever implementation issues it), global module hooks say which module
of the plain model runs in forward, and the autograd nodes a module's forward created are tagged with
its name (``Node.metadata``), so an op of the backward is named by the node the engine is running
(``torch._C._current_autograd_node``). Nothing of the adapter is asked or changed.

Per op that compare.py holds to the yardstick's (an op of a compared phase whose output is written) it
keeps a record: index among the step's ops, step, pass (the micro-batch index of the step), phase, module,
op name, the shape, dtype and a CRC-32 of the output's bytes, and the output itself while the rank's kept
values stay under `keep_bytes` (one copy for outputs of the same bytes: a view, a reshape, a
recomputation). Every other op is only counted (the index) and, where it reads parameters alone, its
outputs marked as such (and their autograd nodes, see below). Around the op records it keeps the rank's state, with values: the parameters it
holds at the start of each step, its gradients after the backward and the reduction, after clipping,
and the parameters after the optimizer step, each with the dim-0 rows of the full parameter it holds
(read from the DTensor's own spec; a plain tensor of the full shape holds them all).

Phases (what `mark` says, as harness.train.features.forward_backward and harness.train.task call it):
``forward`` (an op outside any autograd node), ``recomputation`` (a module's forward run again inside
the backward: activation checkpointing), ``backward`` (an op the engine runs for a node), except two
kinds of node whose ops are counted, not compared: ``parameter preparation``, the node of a forward op
that read parameters (or outputs made from them) alone, a cast, a transpose, a view, whose backward turns a
gradient back into the parameter's (how an implementation prepares its parameters is its own business; a
node is marked so from the op the tracer saw make it, not from the graph's shape, which cannot tell an
input that needs no gradient, an activation or token ids, from one that is not there), and ``gradient
accumulation`` (AccumulateGrad: summing into ``.grad``, and the hooks that run after it). Ops after the
backward (the reduction's tail, clipping, the optimizer step) are compared through the state, not op
by op: their operands are shards, the reference's are full tensors. Collectives are recorded in every
phase with a hash of what the rank put in (before it runs), for the report's context and to tell which
rank put something else into a reduction.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.measure.comm import COLLECTIVE_NAMESPACES, DTENSOR, classify, plain_copy, reduction_input, tensor_digest
from harness.measure.layout import rows_held
from harness.measure.memory import local_tensor
from harness.train.params_file import load_params

COMPARED = ("forward", "recomputation", "backward")  # the phases whose ops are compared op by op (compare.py)
TAG = "harness_localize_module"  # the key of a node's metadata that names the module that made it
PREP = "harness_localize_prep"  # ... set where it only prepares parameters: its forward read parameters alone
# ops whose output is memory not yet written, not a value, or autograd's bookkeeping (the same values as
# their input, made where autograd saves a tensor, which activation checkpointing changes): never compared
UNWRITTEN = {
    "detach",
    "alias",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "set_",
    "resize_",
    "record_stream",
    "_local_scalar_dense",
}
# wrapper modules' attribute names: a wrapped model's parameter names without them are the plain model's
WRAPPER_PARTS = {"module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}


def _outputs(x) -> list[torch.Tensor]:
    """The tensors of a module's or op's output: a tensor, (nested) sequences, dicts (HF ModelOutput)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _outputs(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _outputs(v)]
    return []


def _kind(func) -> tuple[str, str]:
    """What the tracer does with an op, worked out once per op: ("hop", ""): a higher-order operator, run as
    it is; ("c10d", name): of a namespace with collectives (classify says which are); ("unwritten", name):
    its output is never compared; ("op", name): any other. name: the record's (``aten.mm``, the overload
    when it is not the default)."""
    if isinstance(func, torch._ops.HigherOrderOperator):
        return "hop", ""
    name = str(func).removesuffix(".default")
    if getattr(func, "namespace", None) in COLLECTIVE_NAMESPACES:
        return "c10d", name
    return ("unwritten" if func._overloadpacket.__name__ in UNWRITTEN else "op"), name


class StepTracer(TorchDispatchMode):
    """Records the traced steps of one rank. `model`: the plain model before any implementation wraps it
    (its module names are the ones both runs are compared by)."""

    def __init__(self, model: torch.nn.Module, units, keep_bytes: int = 32 << 20, pass_grads: bool = False):
        super().__init__()
        self.names = {id(m): name or "(model)" for name, m in model.named_modules()}
        self.units = [self.names[id(u)] for u in units]
        # the reference of a step with several passes: its gradients after each pass, whose differences are
        # the terms a sharded run sums in another order (the rounding a reduction may legitimately add)
        self.pass_grads = pass_grads
        self._wrapped = None
        self.param_names = {name for name, _ in model.named_parameters()}
        self.keep_bytes, self.kept_bytes = keep_bytes, 0
        self.ops: list[dict] = []
        self.values: dict[int, torch.Tensor] = {}  # op record index -> its output, while under keep_bytes
        self._copies: dict[tuple, torch.Tensor] = {}  # (digest, dtype, numel) -> a value kept (see _value)
        self.state: list[dict] = []  # {"step", "what", "params": {name: (rows, tensor)}}
        self.forced: dict[int, list[str]] = {}  # step -> the parameters whose gradients force_grads replaced
        self.step, self.pass_, self.phase = 0, -1, None
        self._stack: list[str] = []
        self._kinds: dict = {}  # func -> _kind(func)
        self._seen = 0  # the records' index "i": ops seen in a marked phase and collectives, records or not
        self._prepared: dict[int, weakref.ref] = {}  # id -> the op outputs made from parameters alone
        self._untagged: list[weakref.ref] = []  # the last such op's outputs, whose autograd node is not set yet
        self._rows_key, self._rows = None, {}
        self._hooks = []

    # -- the harness says where the step is ----------------------------------------------------------
    def begin_step(self, step: int, wrapped, force_dir: str | None = None) -> None:
        """Before step `step`. `force_dir` (the yardstick's replay): where the run under test's parameters
        after each step are (step<k>.pt, full tensors assembled from its ranks' rows): the yardstick starts
        the step from them, so that every step is compared from the same parameters even after the runs
        parted by a reduction's rounding."""
        self.step, self.pass_, self.phase, self._wrapped = step, -1, None, wrapped
        forced = Path(force_dir) / f"step{step - 1}.pt" if force_dir else None
        if forced is not None and forced.exists():
            params = {self.plain_name(n): p for n, p in wrapped.named_parameters()}
            with torch.no_grad():
                for name, full in load_params(forced).items():
                    # a parameter its ranks held neither whole nor as dim-0 rows (Shard(1)) came back as one
                    # rank's piece, not the full tensor: the yardstick keeps its own
                    if name in params and params[name].shape == full.shape:
                        params[name].copy_(full)
        self._params = [local_tensor(p) for p in wrapped.parameters()]
        self._param_ids = {id(p) for p in self._params}
        # an op that updates a buffer in place (BatchNorm's batch counter): what a split yardstick counts per
        # micro-batch and a rank per step, and nothing the step's forward reads in training
        self._buffer_ids = {id(local_tensor(b)) for b in wrapped.buffers()}
        self._keep_state("params_before", wrapped, grads=False)

    def marking(self, mark):
        """The step's `mark(phase, value)` that also tells this tracer where the step is."""

        def both(phase: str, value=None):
            if phase == "forward":
                if self.pass_grads and self.pass_ >= 0:  # (a yardstick's: summed slices, not divided yet)
                    self.phase = None
                    self._keep_state("grads_pass", self._wrapped, grads=True)
                self.pass_ += 1
                self.phase = "forward"
            elif phase == "backward":
                self._tag_prepared()
                self.phase = "backward"
            return mark(phase, value)

        return both

    def end_backward(self, wrapped, divide_by: int = 1) -> None:
        """After the backward and the adapter's after_backward: the gradients the reduction left.
        `divide_by`: a yardstick that summed the ranks' slices makes its gradient their mean here."""
        self.phase = None
        if divide_by > 1:
            with torch.no_grad():
                for p in wrapped.parameters():
                    if p.grad is not None:
                        p.grad.div_(divide_by)
            for snap in self.state:  # the step's gradients after each pass, on the same scale
                if snap["step"] == self.step and snap["what"] == "grads_pass":
                    for _, g in snap["params"].values():
                        g.div_(divide_by)
        self._keep_state("grads_reduced", wrapped, grads=True)

    def end_clip(self, wrapped) -> None:
        self._keep_state("grads_clipped", wrapped, grads=True)

    def force_grads(self, wrapped, force_dir: str | None) -> None:
        """Before the yardstick's optimizer step (the localiser's replay): the gradients the run under test
        applied in this step (grads<k>.pt, assembled from its ranks' rows) replace the yardstick's own, once
        those are kept for comparison. Its optimizer state then follows the run's gradients, so its update
        is the plain optimizer's on the run's own parameters and gradients: comparable bit for bit even
        after the runs parted by a reduction's rounding. The names it forced are kept (`forced`, per step)."""
        forced = Path(force_dir) / f"grads{self.step}.pt" if force_dir else None
        if forced is None or not forced.exists():
            return
        params = {self.plain_name(n): p for n, p in wrapped.named_parameters()}
        done = self.forced.setdefault(self.step, [])
        with torch.no_grad():
            for name, full in load_params(forced).items():
                p = params.get(name)
                if p is not None and p.grad is not None and p.grad.shape == full.shape:
                    p.grad.copy_(full)
                    done.append(name)

    def end_step(self, wrapped) -> None:
        self._keep_state("params_after", wrapped, grads=False)

    # -- observation ---------------------------------------------------------------------------------
    def __enter__(self):
        from torch.utils.checkpoint import set_checkpoint_early_stop

        nn_hooks = torch.nn.modules.module
        self._hooks = [
            nn_hooks.register_module_forward_pre_hook(self._pre),
            nn_hooks.register_module_forward_hook(self._post),
        ]
        # a recomputation that stops early (once the saved tensors it needs are back) leaves its modules'
        # forward hooks unrun; the whole recomputation runs the same ops to the same values
        self._early_stop = set_checkpoint_early_stop(False)
        self._early_stop.__enter__()
        self._stack.clear()
        self._prepared, self._untagged = {}, []
        return super().__enter__()

    def __exit__(self, *exc):
        self._untagged = []
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._early_stop.__exit__(*exc)
        return super().__exit__(*exc)

    def _pre(self, module, args):
        name = self.names.get(id(module))
        if name is not None:
            self._stack.append(name)

    def _post(self, module, args, output):
        name = self.names.get(id(module))
        if name is None:
            return
        if self._stack and self._stack[-1] == name:
            self._stack.pop()
        # the nodes this call made (inner modules tagged theirs first): the backward ops they run are its
        todo = [t.grad_fn for t in _outputs(output) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or TAG in node.metadata:
                continue
            node.metadata[TAG] = name
            todo.extend(n for n, _ in node.next_functions)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._untagged:
            self._tag_prepared()
        kwargs = kwargs or {}
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _kind(func)
        if kind[0] == "hop":
            return func(*args, **kwargs)
        if DTENSOR is not None and DTENSOR in types:
            return NotImplemented  # its local ops come back here
        if kind[0] == "c10d":
            collective = classify(func, tuple(args))
            if collective is not None:
                if self.step:
                    self._collective(func, collective[0], args)
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.phase is not None:
            self._op(kind, out, args, kwargs)
        return out

    def _tag_prepared(self) -> None:
        """Marks the autograd nodes of the last op's parameter-made outputs as preparing parameters: autograd
        sets a node on an op's outputs after the op returns below it (here), so it is read at the next op (or
        at the backward's start), while every op that could use the outputs has yet to run. The backward ops
        the engine runs for those nodes are the implementation's own business (_where), as their forward
        ops were; every other node's are compared. A recomputation (activation checkpointing) makes nodes of
        its own, marked alike; the engine runs the first forward's."""
        for ref in self._untagged:
            t = ref()
            node = t.grad_fn if t is not None else None
            if node is not None:
                node.metadata[PREP] = True
        self._untagged = []

    def _made_from_params(self, t: torch.Tensor) -> bool:
        if id(t) in self._param_ids:
            return True
        ref = self._prepared.get(id(t))
        return ref is not None and ref() is t

    def _from_params(self, args, kwargs) -> bool:
        """Whether every tensor the op reads is a parameter or made from parameters alone (a cast, a
        transpose): how an implementation prepares its parameters is its own, so such ops are not held
        to the yardstick's; the first op that computes with them is."""
        read = False
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, torch.Tensor):
                if not self._made_from_params(arg):
                    return False
                read = True
            elif isinstance(arg, (list, tuple, dict)):
                for t in _outputs(arg):
                    if not self._made_from_params(t):
                        return False
                    read = True
        return read

    def _where(self) -> tuple[str, str]:
        node = torch._C._current_autograd_node()
        if node is None:  # in the backward phase: after the engine is done (the caller's own bookkeeping)
            phase = self.phase if self.phase == "forward" else "after backward"
            return phase, self._stack[-1] if self._stack else "(outside modules)"
        if self._stack:  # a module's forward inside the backward: activation checkpointing's recomputation
            return "recomputation", self._stack[-1]
        module = node.metadata.get(TAG, "(outside modules)")
        if type(node).__name__ == "AccumulateGrad":  # summing into .grad, and the hooks run after it
            return "gradient accumulation", module
        if PREP in node.metadata:  # the backward of a parameter's preparation (a cast, a transpose)
            return "parameter preparation", module
        return "backward", module

    def _op(self, kind: tuple[str, str], out, args, kwargs) -> None:
        """Marks the outputs of an op on parameters alone; records an op whose output is compared (in a
        compared phase, written, not a buffer's): its hash, and its value while under keep_bytes. The others
        are counted in the index alone: compare reads nothing of them."""
        tensors = [out] if isinstance(out, torch.Tensor) else _outputs(out)
        prep = self._from_params(args, kwargs)
        for t in tensors:
            if prep:
                self._prepared[id(t)] = ref = weakref.ref(t)
                self._untagged.append(ref)
            else:  # (written in place from more than parameters: no longer made from them alone)
                self._prepared.pop(id(t), None)
        i = self._seen
        self._seen += 1
        if kind[0] == "unwritten" or not tensors:
            return
        phase, module = self._where()
        if phase not in COMPARED or any(id(t) in self._buffer_ids for t in tensors):
            return
        digest = "|".join(tensor_digest(t) for t in tensors)
        self.ops.append(
            {
                "i": i,
                "step": self.step,
                "pass": self.pass_,
                "phase": phase,
                "module": module,
                "op": kind[1],
                "shape": [list(t.shape) for t in tensors],
                "dtype": str(tensors[0].dtype).removeprefix("torch."),
                "digest": digest,
                "prep": prep,
            }
        )
        if len(tensors) == 1:
            t = tensors[0]
            size = t.numel() * t.element_size()
            if self.kept_bytes + size <= self.keep_bytes:
                self.kept_bytes += size
                self.values[i] = self._value(t, digest)

    def _value(self, t: torch.Tensor, digest: str) -> torch.Tensor:
        """A copy of an op's output; where an earlier op's kept output holds the same bytes (a view or reshape of
        it, a recomputation: a large share of a step's outputs, reports/performance.md#the-localiser), that
        copy, seen in this one's shape."""
        key = (digest, t.dtype, t.numel())
        same = self._copies.get(key)
        if same is not None and not torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python):
            with torch._C._DisableTorchDispatch():  # the kept copies are on the CPU, a device's outputs are not
                if torch.equal(same.view(t.shape), t if t.device == same.device else t.to(same.device)):
                    return same.view(t.shape)
        self._copies[key] = copy = plain_copy(t)
        return copy

    def _collective(self, func, kind: str, args) -> None:
        sent = reduction_input(func, args) or []
        phase, module = self._where() if self.phase is not None else ("after backward", "(outside modules)")
        i = self._seen
        self._seen += 1
        self.ops.append(
            {
                "i": i,
                "step": self.step,
                "pass": self.pass_,
                "phase": phase,
                "module": module,
                "op": f"{kind} ({func._overloadpacket.__name__})",
                "collective": kind,
                "shape": [list(t.shape) for t in sent],
                "dtype": "",
                "digest": None,
                "sent": "|".join(tensor_digest(t) for t in sent) if sent else None,
            }
        )

    def _keep_state(self, what: str, wrapped, grads: bool) -> None:
        params = list(wrapped.named_parameters())
        # the rows follow from each DTensor's shape, mesh and placements: worked out again only when they change
        key = [(name, getattr(p, "placements", None), getattr(p, "device_mesh", None), p.shape) for name, p in params]
        if key != self._rows_key:
            self._rows_key, self._rows = key, rows_held(wrapped)
        held = {}
        with torch.no_grad():  # a DTensor's local tensor as it is (no autograd function)
            for name, p in params:
                t = p.grad if grads else p
                if t is not None:
                    held[self.plain_name(name)] = (self._rows.get(name), plain_copy(local_tensor(t), torch.float32))
        self.state.append({"step": self.step, "what": what, "pass": self.pass_, "params": held})

    def plain_name(self, name: str) -> str:
        """A wrapped model's parameter name as the plain model has it (wrapper modules' parts dropped)."""
        if name in self.param_names:
            return name
        return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)

    def save(self, path: Path) -> None:
        torch.save(
            {
                "ops": self.ops,
                "values": self.values,
                "state": self.state,
                "forced": self.forced,
                "units": self.units,
                "kept_bytes": self.kept_bytes,
                "keep_bytes": self.keep_bytes,
            },
            path,
        )
