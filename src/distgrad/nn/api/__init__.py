"""``torch.distributed.nn.api``'s path: ``distgrad.nn.api.remote_module``."""
