"""A cache directory is this user's own, or it is refused (docs/security.md, "other local users").

The sampler writes and removes files in the cache and the loader reads shards and writes its lease there, so a
folder another local user made (``/dev/shm`` is shared by every user of the host) could feed a trainer their
data, or turn a clean-up into a removal of their choosing. So the cache root and the folders feedline writes in
(``shards/``, ``shards/.partial/``, ``readers/``) must be folders — not symbolic links — owned by the user
feedline runs as (the root may also be root's: a mount point); feedline makes them mode 0700 (other users can neither read nor write them) and tightens
folders of its own that are more open. Run the sampler and the trainer as one user (compose and the Kubernetes
manifests do: uid 10001).
"""

from __future__ import annotations

import os
import stat

DIR_MODE = 0o700


class CacheDirError(ValueError):
    """The cache directory cannot be this store's: the message names the path and what to do."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_folder(path: str, create: bool, root_ok: bool = False) -> bool:
    """``path`` is a folder of this user's (made mode 0700 when ``create`` and missing); False when it is missing.

    A symbolic link, something that is not a folder, or a folder owned by another user is a ``CacheDirError``
    naming it; a folder of this user's that others may read or write is made 0700. ``root_ok``: the cache root
    may also be root's — a mount point (a Kubernetes emptyDir or volume, /dev/shm itself) that the folders
    feedline makes in it, which must be this user's, are what is protected.
    """
    if create:
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise CacheDirError(f"{path} is a symbolic link (to {os.readlink(path)}): the cache writes and removes "
                            f"files there, so it must be a folder of its own; remove the link, or use another "
                            f"cache directory")
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"{path} is not a folder: remove it, or use another cache directory")
    me = os.geteuid()
    if st.st_uid != me and not (st.st_uid == 0 and root_ok):
        raise CacheDirError(f"{path} belongs to {_owner(st.st_uid)}, not to {_owner(me)} that feedline runs as: "
                            f"a cache another user made could feed this run their data; use a cache directory of "
                            f"your own (e.g. /dev/shm/feedline-{me}), or run the sampler and the trainer as its owner")
    if st.st_uid == me and stat.S_IMODE(st.st_mode) & 0o077:
        try:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
        except OSError as exc:  # a filesystem without Unix modes (vfat, some FUSE): other users' access is its own
            raise CacheDirError(f"{path} cannot be made private to {_owner(me)} ({exc.strerror}): put the cache on "
                                f"a filesystem with Unix modes (/dev/shm, a local disk)") from None
    return True


def claim_cache_dir(root: str, folders: tuple[str, ...]) -> None:
    """The sampler's start: the root and ``folders`` under it (relative, parents first) made or checked as ours.

    The root's parents are made with the default mode, as ``os.makedirs`` would; only what feedline owns is 0700.
    A root that is a link the user made (owned by this user) is followed, as a path the user gave; one owned by
    another user is refused.
    """
    root = os.path.abspath(root)
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    if os.path.islink(root) and os.lstat(root).st_uid == os.geteuid():
        root = os.path.realpath(root)
    check_folder(root, create=True, root_ok=True)
    for f in folders:
        check_folder(os.path.join(root, f), create=True)


def check_cache_dir(root: str, folders: tuple[str, ...]) -> bool:
    """The loader's check of a cache the sampler made: what exists must be ours; False while the root is missing."""
    root = os.path.abspath(root)
    if os.path.islink(root) and os.lstat(root).st_uid == os.geteuid():
        root = os.path.realpath(root)
    if not check_folder(root, create=False, root_ok=True):
        return False
    for f in folders:
        check_folder(os.path.join(root, f), create=False)
    return True
