"""One module per framework: the primitives of ``multiattn.adapter.Ops`` and
the framework-native layer classes.  Loaded on demand by ``multiattn.get_backend``."""
