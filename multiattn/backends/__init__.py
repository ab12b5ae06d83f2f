"""One module per framework: the primitives of ``multiattn.protocol.Ops`` and
the framework-native layer classes.  Loaded on demand by ``multiattn.get_backend``."""
