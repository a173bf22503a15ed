"""RemoteModule (layer 5): built on the public RPC API."""
