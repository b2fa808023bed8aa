pytest_plugins = ["stratagem.testing.pytest_plugin"]

# Imported by interpreters that tests/test_paths.py starts, never by pytest: a module named
# sitecustomize would clash with the interpreter's own, if it has one.
collect_ignore = ["scripts/audit/sitecustomize.py"]
