# The harness's pytest plugin (options, session run, report) lives in harness/plugin.py and is also
# registered through the `pytest11` entry point when the package is installed.
import os

pytest_plugins = ["harness.plugin"]

# Where PYTHONDONTWRITEBYTECODE is set, every process the suites start (the xdist workers, the CLI and pytest
# runs the tests make, each one's forkserver: about two hundred) compiled the project's modules from source
# again, about 0.3 CPU s each. The suites' processes write and reuse bytecode (the gitignored __pycache__
# folders); the shell that started pytest keeps its setting.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
