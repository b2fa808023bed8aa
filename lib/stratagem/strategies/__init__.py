"""Built-in strategies, one module each; every one is a factory returning a `Strategy`."""
