# The harness's pytest plugin (options, session run, report) lives in harness/plugin.py and is also
# registered through the `pytest11` entry point when the package is installed.
pytest_plugins = ["harness.plugin"]
