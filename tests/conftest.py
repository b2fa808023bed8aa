pytest_plugins = ["stratagem.testing.pytest_plugin"]

# The scripts are programs that tests start (some with top-level code that trains, or a
# sitecustomize that would clash with the interpreter's own): never imported by pytest.
collect_ignore_glob = ["scripts/*"]
