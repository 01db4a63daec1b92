"""Names the command line accepts, kept free of torch so that a usage error answers at once.

`harness.adapters.BUILTINS`, `harness.train.models.MODELS` and `harness.train.standard_models.STANDARD_MODELS`
are the registries behind these names;
`suites/harness/unit/test_inputs.py` holds them equal, so a name added there must be added here.
"""

BUILTIN_ADAPTERS = (
    "reference",
    "fsdp_impl",
    "torch_fsdp2",
    "torch_fsdp2_fp64reduce",
    "torch_fsdp1",
    "ddp",
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero3",
)
ADAPTER_FORMS = "'cs336:<module>', or 'package.module:object'"
MODELS = ("mlp", "mlp_frozen", "tinylm", "tinylm_tied", "tied_vocab33", "gpt2_medium", "lm_50m")
# standard architectures from torch's own layers: harness.train.standard_models.STANDARD_MODELS
STANDARD_MODELS = ("mha_lm", "encoder_lm", "bn_mlp")
# Hugging Face transformers models (optional extra `pip install -e .[hf]`): harness.train.hf_models.HF_SPECS
HF_PREFIX = "hf:"
HF_MODELS = ("hf:gpt2", "hf:llama")


def unknown_adapter(name: str) -> str:
    return f"unknown adapter {name!r}; valid: {', '.join(BUILTIN_ADAPTERS)}, {ADAPTER_FORMS}"


def unknown_hf_model(name: str) -> str:
    return f"unknown Hugging Face model {name!r}; valid: {', '.join(HF_MODELS)}"
