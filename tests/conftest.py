pytest_plugins = ["stratagem.testing.pytest_plugin"]
