"""A member's own msgpack extension values, kept apart from feedline's.

``msgpack.unpackb`` gives a member's extension values as ``msgpack.ExtType``; feedline's side channel
(``loader/layout/tree.py``) uses extension types of its own for arrays and tensors. A member that holds an
extension imitating one of those must never be read as one (8 bytes claiming to be a 2 GiB array), so the
msgpack decoder gives extension values as this subclass — equal to ``msgpack.ExtType`` in every way a user
sees — and the side channel wraps it whole.
"""

from __future__ import annotations

import msgpack


class MemberExtType(msgpack.ExtType):
    """An extension value a member held (code, data): data, never decoded as feedline's own."""

    __slots__ = ()
