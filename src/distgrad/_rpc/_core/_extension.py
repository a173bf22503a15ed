"""The call-recording role of the layer protocol (``_layer``), as the call path reads it.

:func:`get_extension` is the registered layer that records calls (distributed autograd), or
``None``: then a call costs nothing extra. (The call path itself reads ``_layer._recorder``,
no call.) Its record, :class:`CallRecord`, travels in the message's tensor table.
"""

from __future__ import annotations

from ._layer import CallRecord
from ._layer import call_recorder as get_extension

__all__ = ["CallRecord", "get_extension"]
