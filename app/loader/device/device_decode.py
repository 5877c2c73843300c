"""``device_decode=``: JPEG fields decoded where the batch lands, in batches; the workers copy compressed bytes.

Where the CPUs cannot decode as fast as the GPU trains (8-16 cores per GPU), the workers only place
each image's compressed bytes in a padded variable-length ring field (``<name>`` and
``<name>_len``), a fraction of the decoded size. The stage that hands batches over then decodes the
whole batch in one call — on a CUDA device with nvJPEG (``torchvision.io.decode_jpeg`` with
``device="cuda"``) or nvImageCodec, reading the pinned slot directly — and crops and resizes each
image there (torch's antialiased bilinear), so the training loop receives ``(N, H, W, 3)`` uint8
images on the device as with CPU decoding. On a CPU host Pillow decodes in the loop's thread through
the same crop-and-resize code: no faster than the workers, but the same path, tested everywhere.

A member the batch decoder refuses (not a JPEG, a codec error) is decoded alone by Pillow; one
Pillow cannot read either is dropped from the batch — every field of that row — and counted as a
``corrupt`` sample. Each image's crop is drawn from ``(seed, epoch, key)``: a sample gets the same
crop on every run, after a resume and after a worker is replaced, whichever batch it lands in.
"""

from __future__ import annotations

import importlib
import io
import logging
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import SettingError
from ...formats.images import decode_image, image_formats
from ...formats.transforms import random_box
from ..layout.sample import FieldSelection
from ..layout.spec import Field, Spec, next_pow2
from .decode_settings import DeviceDecode

log = logging.getLogger("feedline.loader")


class AsCompressed:
    """The workers' decoder of a ``device_decode`` field: the member's bytes as a 1-D uint8 array, kept
    compressed — once its header says its pixels fit ``max_member_bytes`` (the trainer or the GPU decodes it,
    where ``worker_memory`` does not reach). Picklable, unlike a closure."""

    def __init__(self, bound: int):
        self.bound = bound

    def __call__(self, data: memoryview) -> np.ndarray:
        decode_image(data, self.bound)  # the header only: a lazy image, no pixel decoded
        return np.frombuffer(data, dtype=np.uint8)


def pick_backend(wanted: str, device: torch.device) -> list[str]:
    """The backends that may run, in the order to try them, or a ``SettingError`` saying what to install."""
    if device.type != "cuda":
        if wanted not in ("auto", "pillow"):
            raise SettingError("device_decode", f"backend={wanted!r} decodes on a CUDA device, but device="
                                                f"{str(device)!r}; use backend='auto' (Pillow on a CPU)")
        return ["pillow"]
    if wanted == "pillow":
        return ["pillow"]
    found = [name for name, ok in (("nvjpeg", _has_torchvision_decode()), ("nvimgcodec", _has_nvimgcodec())) if ok]
    if wanted != "auto":
        found = [name for name in found if name == wanted]
    if not found:
        raise SettingError(
            "device_decode", f"backend={wanted!r} on CUDA needs torchvision's decode_jpeg (a torchvision built for "
                             f"this torch) or nvImageCodec (pip install nvidia-nvimgcodec-cu12), and neither "
                             f"{'is' if wanted == 'auto' else 'of those asked for is'} importable here; install one, "
                             f"or pass backend='pillow' (decodes on the CPU, in the training process)")
    return found


def _has_torchvision_decode() -> bool:
    try:  # not installed, or built for another torch ('operator torchvision::nms does not exist')
        return hasattr(importlib.import_module("torchvision.io"), "decode_jpeg")
    except Exception:
        return False


def _has_nvimgcodec() -> bool:
    try:
        importlib.import_module("nvidia.nvimgcodec")
    except Exception:
        return False
    return True


def worker_decode(decode: bool | Mapping[str, Callable[[memoryview], Any]], spec: Spec | Mapping[str, Any] | None,
                  settings: DeviceDecode, selection: FieldSelection, bound: int
                  ) -> tuple[dict[str, Callable[[memoryview], Any]], Spec | None]:
    """(the workers' decoders, the declared spec): the device-decoded fields' members kept compressed
    (``AsCompressed``: their pixels checked against ``bound``), declared as such (``compressed_spec``)."""
    if decode is False:
        raise SettingError("device_decode", "decode=False keeps every member raw; use decode=True (or a dict of "
                                            "overrides) with device_decode")
    names = selection.names
    missing = [f for f in settings.fields if names is not None and f not in names]
    if missing:
        raise SettingError("device_decode", f"fields {missing} are not among fields= ({selection.describe()}); "
                                            f"name the batch fields to decode")
    exts = {e for f in settings.fields for e in (names[f] if names is not None else (f,))}
    return ({**(decode if isinstance(decode, Mapping) else {}), **{e: AsCompressed(bound) for e in exts}},
            compressed_spec(Spec.parse(spec), settings) if spec is not None else None)


def compressed_spec(spec: Spec, settings: DeviceDecode) -> Spec:
    """``spec`` with each device-decoded field a padded variable-length uint8 field (compressed bytes)."""
    fields = []
    for f in spec.fields:
        if f.name in settings.fields and not (f.variable and f.dtype == "|u1" and len(f.shape) == 1):
            if f.side or f.dtype != "|u1" or len(f.shape) != 1:
                raise SettingError("device_decode", f"field {f.name!r} holds {f.dtype} {f.shape} in the spec; a "
                                                    f"device-decoded field holds compressed bytes: declare it "
                                                    f"{{'dtype': 'uint8', 'shape': [capacity], 'variable': True}} "
                                                    f"or leave it to be inferred")
            f = Field(f.name, "uint8", (next_pow2(max(64, int(f.shape[0] * 1.25))),), f.source, variable=True)
        fields.append(f)
    absent = set(settings.fields) - {f.name for f in fields}
    if absent:
        raise SettingError("device_decode", f"fields {sorted(absent)} are not in the batch spec "
                                            f"({', '.join(f.name for f in fields)})")
    return Spec(tuple(fields))


def crop_box(height: int, width: int, settings: DeviceDecode, rng: random.Random) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of the region one image is resized from."""
    if settings.crop == "random":
        x0, y0, x1, y1 = random_box(width, height, settings.scale, settings.ratio, rng)
    else:
        oh, ow = settings.size  # type: ignore[misc]
        if width * oh > height * ow:  # wider than the output: full height
            cw, ch = height * ow / oh, float(height)
        else:
            cw, ch = float(width), width * oh / ow
        x0, y0 = (width - cw) / 2, (height - ch) / 2
        x1, y1 = x0 + cw, y0 + ch
    top, left = int(y0), int(x0)
    return top, left, max(top + 1, min(height, round(y1))), max(left + 1, min(width, round(x1)))


def crop_resize(image: torch.Tensor, box: tuple[int, int, int, int], size: tuple[int, int], flip: bool) -> torch.Tensor:
    """A CHW uint8 image cropped to ``box`` and resized to ``size``, on its own device, as HWC uint8."""
    top, left, bottom, right = box
    x = image[:, top:bottom, left:right].unsqueeze(0).float()
    x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)[0]
    if flip:
        x = x.flip(-1)
    return x.round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0)


def _pillow_chw(data: np.ndarray) -> torch.Tensor:
    from PIL import Image

    with Image.open(io.BytesIO(data.tobytes()), formats=image_formats()) as img:
        rgb = np.array(img.convert("RGB"))  # writable: torch takes it as it is
    return torch.from_numpy(rgb).permute(2, 0, 1)


class DeviceDecoder:
    """Decodes a batch's compressed image fields on ``device`` and fits the batch's other fields to what survived."""

    def __init__(self, settings: DeviceDecode, device: torch.device, seed: int,
                 on_corrupt: Callable[[int], None] = lambda n: None):
        self.settings = settings
        self.device = device
        self.seed = seed
        self.epoch = 0  # the loader's, set as each epoch starts: a seed of the crops
        self._on_corrupt = on_corrupt
        self._local = threading.local()  # an nvImageCodec decoder per transfer thread
        self._warned = False
        if device.type == "cuda" and device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        tried = []
        for backend in pick_backend(settings.backend, self.device):  # each tried on a small JPEG, once
            self.backend = backend
            why = self._works()
            if why is None:
                break
            tried.append(f"{backend}: {why}")
        else:
            raise SettingError("device_decode", f"no backend decoded a test JPEG on {self.device} "
                                                f"({'; '.join(tried)}); pass backend='pillow' to decode on the CPU")
        log.info("device_decode: %s decoded on %s by %s, %dx%d, %s crop", ", ".join(settings.fields), device,
                 self.backend, settings.size[0], settings.size[1], settings.crop)  # type: ignore[index]

    def _works(self) -> str | None:
        """None if this backend decodes a small JPEG on the device, else why not."""
        if self.backend == "pillow":
            return None
        buf = io.BytesIO()
        from PIL import Image

        Image.new("RGB", (16, 8), (200, 30, 30)).save(buf, format="JPEG")
        try:
            img = self._batch([torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)])[0]
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        if img is None or tuple(img.shape) != (3, 8, 16) or img.device != self.device:
            return f"it returned {None if img is None else (tuple(img.shape), str(img.device))}"
        return None

    def apply(self, tensors: dict[str, torch.Tensor], extra: dict[str, list[Any]],
              origin: tuple[int, int]) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
        """``tensors`` with each image field decoded (``<name>_len`` gone); rows nothing could decode dropped.

        ``origin`` is (worker, batch number); each row's crop is seeded by the seed, the epoch and its key.
        """
        keys = extra["__key__"]  # every batch carries its keys (side.py)
        out = dict(tensors)
        bad: set[int] = set()
        decoded: dict[str, list[torch.Tensor | None]] = {}
        for name in self.settings.fields:
            data, lengths = out.pop(name), out.pop(f"{name}_len")
            members = [data[i, : int(n)] for i, n in enumerate(lengths.tolist())]
            images = self._decode(members)
            bad.update(i for i, img in enumerate(images) if img is None)
            decoded[name] = images
        n = len(next(iter(decoded.values()))) if decoded else 0
        keep = [i for i in range(n) if i not in bad]
        for name, images in decoded.items():
            fitted = []
            for i in keep:
                img = images[i]
                assert img is not None
                rng = random.Random(f"feedline-device-decode:{self.seed}:{self.epoch}:{name}:{keys[i]}")
                box = crop_box(img.shape[1], img.shape[2], self.settings, rng)
                flip = self.settings.crop == "random" and self.settings.flip and rng.random() < 0.5
                fitted.append(crop_resize(img, box, self.settings.size, flip))  # type: ignore[arg-type]
            h, w = self.settings.size  # type: ignore[misc]
            out[name] = (torch.stack(fitted) if fitted
                         else torch.empty((0, h, w, 3), dtype=torch.uint8, device=self.device))
        if bad:
            self._on_corrupt(len(bad))
            rows = torch.tensor(keep, dtype=torch.long)
            out = {k: v if k in decoded else v.index_select(0, rows.to(v.device)) for k, v in out.items()}
            extra = {k: [v[i] for i in keep] for k, v in extra.items()}
        return out, extra

    def _decode(self, members: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """CHW uint8 images on the device, None where nothing could decode the member."""
        if self.backend == "pillow":
            return [self._one_pillow(m) for m in members]
        jpeg = [i for i, m in enumerate(members) if len(m) > 2 and int(m[0]) == 0xFF and int(m[1]) == 0xD8]
        out: list[torch.Tensor | None] = [None] * len(members)
        try:
            for i, img in zip(jpeg, self._batch([members[i] for i in jpeg])):
                out[i] = img
        except RuntimeError as exc:  # one bad member fails the batch call: decode them one by one
            if not self._warned:
                self._warned = True
                log.warning("device_decode: a batch call of %s failed (%s); its members are decoded one by one, "
                            "those it refuses by Pillow on the CPU (logged once)", self.backend, exc)
            for i in jpeg:
                try:
                    out[i] = self._batch([members[i]])[0]
                except RuntimeError:
                    out[i] = None
        for i, img in enumerate(out):
            if img is None:  # not a JPEG, or refused: Pillow on the CPU, then to the device
                cpu = self._one_pillow(members[i])
                out[i] = cpu.to(self.device) if cpu is not None else None
        return out

    def _batch(self, members: list[torch.Tensor]) -> list[torch.Tensor | None]:
        if not members:
            return []
        if self.backend == "nvjpeg":
            from torchvision.io import ImageReadMode, decode_jpeg

            return list(decode_jpeg(members, mode=ImageReadMode.RGB, device=self.device))
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            from nvidia import nvimgcodec

            decoder = self._local.decoder = nvimgcodec.Decoder(device_id=self.device.index)
        # on this thread's stream, so the crops after it (and the slot's release) wait for it
        images = decoder.decode([m.numpy() for m in members],
                                cuda_stream=torch.cuda.current_stream(self.device).cuda_stream)
        return [torch.as_tensor(img, device=self.device).permute(2, 0, 1) if img is not None else None
                for img in images]

    @staticmethod
    def _one_pillow(member: torch.Tensor) -> torch.Tensor | None:
        try:
            return _pillow_chw(member.numpy())
        except Exception as exc:  # Pillow raises many kinds for bad data
            log.debug("cannot decode a member: %s", exc)
            return None
