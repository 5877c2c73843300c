"""Video members decoded to clips in the workers (VideoClip): the frames asked for and no others, one box a clip,
seeded like every other draw, bounded, and every bad video counted and skipped. The videos are made here with
PyAV's own encoders (tests/videos.py: H.264 and VP9, each frame a grey whose level is its index)."""

import os
import struct
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import ROOT, write_tar
from videos import ffmpeg_video, frame_index, video_bytes

from feedline import StagingLoader
from feedline.formats.video import VideoMember, open_clips
from feedline.formats.video_clip import VideoClip

CODECS = ["h264", "vp9"]
EXT = {"h264": "mp4", "vp9": "webm"}


def indices(clip, pattern: bool = False) -> list[int]:
    return [frame_index(np.asarray(f), pattern) for f in clip]


def shards_of(tmp_path, videos: dict[str, bytes], ext: str = "mp4", per_shard: int = 4) -> str:
    """``videos`` (key -> bytes) with a label each (its position), in shards of ``per_shard``."""
    items = sorted(videos.items())
    for s in range(0, len(items), per_shard):
        write_tar(str(tmp_path / f"v-{s // per_shard}.tar"),
                  [(key, {ext: data, "cls": str(s + i).encode()}) for i, (key, data) in enumerate(items[s:s + per_shard])])
    return str(tmp_path / "v-*.tar")


@pytest.mark.parametrize("codec", CODECS)
def test_a_clip_holds_frames_stride_apart_from_one_window_and_nothing_else(codec):
    data = VideoMember(video_bytes(codec, frames=50, fps=25))
    clip = VideoClip(frames=8, stride=3, size=16, mode="center")
    out = clip({"__key__": "k", EXT[codec]: data})
    got = indices(out[EXT[codec]])
    start = got[0]
    assert got == [start + 3 * i for i in range(8)]  # 8 frames, 3 apart
    assert abs(start - (49 - 21) / 2) <= 1  # the middle window of 50 frames
    assert out[EXT[codec]].shape == (8, 16, 16, 3) and out[EXT[codec]].dtype == np.uint8
    assert np.allclose(out[f"{EXT[codec]}_time"], np.array(got) / 25, atol=1e-3)
    assert out[f"{EXT[codec]}_fps"] == pytest.approx(25.0)


def test_random_windows_differ_between_draws_and_repeat_with_the_same_seed():
    import random

    data = VideoMember(video_bytes("h264", frames=50))
    clip = VideoClip(frames=4, stride=2, size=8)
    random.seed(1)
    first = [indices(clip({"mp4": data})["mp4"])[0] for _ in range(6)]
    random.seed(1)
    again = [indices(clip({"mp4": data})["mp4"])[0] for _ in range(6)]
    assert first == again and len(set(first)) > 2
    assert all(0 <= s <= 49 - 6 for s in first)


def test_one_box_is_cut_from_every_frame_of_a_clip():
    import random

    data = VideoMember(video_bytes("h264", frames=20, size=(96, 64), pattern=True))
    random.seed(3)
    frames = VideoClip(frames=6, stride=2, size=24, scale=(0.2, 0.5))({"mp4": data})["mp4"]
    blue = frames[..., 2].astype(int)  # the still gradient: where the box was cut, the same in every frame
    assert np.abs(blue - blue[0]).max() <= 6 and blue[0].max() - blue[0].min() > 20
    got = indices(frames, pattern=True)
    assert got == [got[0] + 2 * i for i in range(6)]


def test_several_clips_a_video_are_spread_evenly_in_center_mode():
    data = VideoMember(video_bytes("h264", frames=50))
    out = VideoClip(frames=4, stride=1, size=8, mode="center", clips=3)({"mp4": data})
    assert out["mp4"].shape == (3, 4, 8, 8, 3) and out["mp4_time"].shape == (3, 4)
    starts = [indices(c)[0] for c in out["mp4"]]
    assert starts == sorted(starts) and starts[0] < 15 and starts[-1] > 30


def test_a_variable_frame_rate_is_sampled_by_timestamp():
    times = [0, 0.05, 0.07, 0.2, 0.21, 0.5, 0.9, 1.0, 1.3, 1.35]
    container, info, reader = open_clips(video_bytes("h264", frames=10, times=times))
    try:
        asked = [0, 1, 2, 3, 5, 8, 12]
        clip, stamps = reader.frames(asked, (0, 0, 64, 48), (8, 8), False, pad=True)
        rate = info.clock.rate
    finally:
        container.close()
    at = [round(Fraction(t).limit_denominator(1000) * rate) for t in times]  # each frame's number at the mean rate
    # frame n: the first whose time rounds to n; where none does, the last one before
    want = [at.index(n) if n in at else max(i for i, a in enumerate(at) if a < n) for n in asked]
    assert indices(clip) == want == [0, 2, 3, 4, 5, 6, 8]
    assert np.allclose(stamps, [times[i] for i in want], atol=1e-3)


RATES = [24, 25, Fraction(30000, 1001), 30, 60]


@pytest.mark.parametrize("time_base", [Fraction(1, 1000), Fraction(1, 15360), Fraction(1, 30000), Fraction(1, 90000)],
                         ids=str)
def test_a_clock_maps_each_frames_stamp_to_its_number_and_back(time_base):
    from feedline.formats.video_clock import FrameClock

    for rate in map(Fraction, RATES):
        clock = FrameClock(time_base, rate, origin=7)
        for n in range(3000):
            stamp = 7 + round(n / rate / time_base)  # as a muxer stamps frame n
            assert clock.number(stamp) == n
            assert stamp <= clock.pts(n) and clock.number(clock.pts(n)) == n and clock.number(clock.pts(n) + 1) == n + 1


def every_window(reader, count: int, clip: int = 4, strides=(1, 2, 3, 4)):
    """(asked, got, stamps) for every window start of every stride."""
    for stride in strides:
        for first in range(count - (clip - 1) * stride):
            asked = [first + i * stride for i in range(clip)]
            images, stamps = reader.frames(asked, (0, 0, 64, 48), (8, 8), False, pad=False)
            yield asked, indices(images), stamps


@pytest.mark.parametrize("fps", RATES, ids=str)
@pytest.mark.parametrize("codec", CODECS)
def test_every_window_start_of_every_stride_takes_exactly_the_frames_asked(codec, fps):
    """WebM keeps milliseconds (frame 2 at 30 fps is stamped 67 ms, past 2/30 s), 29.97 fps is 30000/1001: frames
    are matched by number, so none is the one before or after, whatever the rate and the time base."""
    container, info, reader = open_clips(video_bytes(codec, frames=40, fps=fps, gop=12))
    try:
        assert info.count == 40
        for asked, got, stamps in every_window(reader, 40):
            assert got == asked
            assert np.allclose(stamps, np.array(asked) / float(fps), atol=6e-4), (asked, stamps)
    finally:
        container.close()


@pytest.mark.parametrize("fps", [Fraction(30000, 1001), 30, 60], ids=str)
@pytest.mark.parametrize("codec,ext", [("h264", "mp4"), ("vp9", "webm"), ("h264", "mkv")])
def test_videos_made_by_the_ffmpeg_command_give_exactly_the_frames_asked(tmp_path, codec, ext, fps):
    path = ffmpeg_video(str(tmp_path / f"clip.{ext}"), codec, frames=40, fps=fps, gop=12)
    container, info, reader = open_clips(open(path, "rb").read())
    try:
        assert info.count == 40
        for asked, got, _ in every_window(reader, 40, strides=(1, 2)):
            assert got == asked
    finally:
        container.close()


@pytest.mark.parametrize("fps", [30, 60])
@pytest.mark.parametrize("mode", ["random", "center"])
def test_clips_of_a_webm_video_hold_the_frames_stride_apart_their_times_say(fps, mode):
    """The user's report: stride 2 from 30 fps VP9 gave frames 57, 58, 61, 63 ... where 57, 59, 61 ... were asked."""
    import random

    data = VideoMember(video_bytes("vp9", frames=90, fps=fps, gop=30))
    clip = VideoClip(frames=8, stride=2, size=8, mode=mode, clips=1 if mode == "random" else 3)
    starts = set()
    for seed in range(40 if mode == "random" else 1):
        random.seed(seed)
        out = clip({"webm": data})
        for images, stamps in zip(out["webm"].reshape(-1, 8, 8, 8, 3), out["webm_time"].reshape(-1, 8)):
            got = indices(images)
            assert got == [got[0] + 2 * i for i in range(8)], (seed, got)
            assert np.allclose(stamps, np.array(got) / fps, atol=6e-4)
            starts.add(got[0])
    if mode == "random":  # windows start anywhere the clip fits, the last frame included
        assert min(starts) <= 8 and max(starts) >= 89 - 14 - 8 and max(starts) <= 89 - 14
    else:
        assert sorted(starts) == [(2 * k + 1) * 75 // 6 for k in range(3)]


def test_decode_threads_take_the_same_frames():
    data = video_bytes("h264", frames=60, fps=30, gop=30)
    got = []
    for threads in (1, 3):
        container, _, reader = open_clips(data, threads)
        try:
            got.append([g for _, g, _ in every_window(reader, 60, clip=6, strides=(2, 3))])
        finally:
            container.close()
    assert got[0] == got[1]
    assert got[0] == [[f + s * i for i in range(6)] for s in (2, 3) for f in range(60 - 5 * s)]


def test_a_video_shorter_than_its_clip_is_padded_with_its_last_frame_or_skipped():
    short = VideoMember(video_bytes("h264", frames=6))
    padded = indices(VideoClip(frames=5, stride=2, size=8, short="pad")({"mp4": short})["mp4"])
    assert padded[:3] == [0, 2, 4] and padded[3:] == [5, 5]
    from feedline.formats.bounds import SampleRejected

    with pytest.raises(SampleRejected, match="shorter than its clip") as exc:
        VideoClip(frames=5, stride=2, size=8, short="skip")({"mp4": short})
    assert exc.value.reason == "too_short"


def test_a_clip_larger_than_max_member_bytes_is_refused_before_a_frame_is_decoded():
    from feedline.formats.bounds import MemberTooLarge
    from feedline.formats.video import decode_video

    member = decode_video(memoryview(video_bytes("h264", frames=20, size=(320, 240))), bound=320 * 240 * 3 * 7)
    with pytest.raises(MemberTooLarge, match="a clip of 8 frames of 320x240"):
        VideoClip(frames=8, stride=1, size=16)({"mp4": member})
    VideoClip(frames=7, stride=1, size=16)({"mp4": member})  # within the bound


def test_a_header_that_declares_more_than_its_bytes_can_hold_is_refused():
    from feedline.formats.bounds import DecodeError

    data = bytearray(video_bytes("h264", frames=20))
    at = data.index(b"stts") + 4  # the sample table: its first (only) entry's count of frames
    struct.pack_into(">I", data, at + 8, 0x7FFFFFF)  # 134 million frames, in a few kilobytes
    with pytest.raises(DecodeError, match="declares 134217727 frames .* but the member holds"):
        VideoClip(frames=4, size=8)({"mp4": VideoMember(bytes(data))})


def test_bad_videos_are_counted_and_skipped_and_the_epoch_completes(tmp_path):
    good = {f"g{i}": video_bytes("h264", frames=30) for i in range(6)}
    whole = video_bytes("h264", frames=30)
    bad = {"b-truncated": whole[: len(whole) // 3], "b-garbage": os.urandom(4000),
           "b-noise-header": b"\x00\x00\x00\x18ftypmp42" + os.urandom(3000),
           "b-short": video_bytes("h264", frames=3)}
    shards = shards_of(tmp_path, {**good, **bad})
    with StagingLoader(shards, batch_size=2, workers=2, fields=["mp4", "cls"], max_sample_errors=10,
                       transform=VideoClip(frames=4, stride=2, size=16, short="skip")) as loader:
        keys = [k for b in loader for k in b["__key__"]]
        errors = loader.stats().sample_errors_total
        restarts = loader.stats().worker_restarts_total
    assert set(good) <= set(keys) and not {"b-garbage", "b-noise-header", "b-short"} & set(keys)
    # a third of an mp4 whose index is at its end reads as nothing (corrupt); one with it in front, too short
    assert errors["too_short"] >= 1 and errors["corrupt"] >= 2
    assert errors["too_short"] + errors["corrupt"] == 4 - ("b-truncated" in keys)
    assert restarts == 0  # counted and skipped, no worker lost


def test_a_container_without_a_video_stream_is_refused_naming_it(tmp_path):
    import io

    import av

    from feedline.formats.bounds import DecodeError

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("aac", rate=48000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 48000
        for packet in list(stream.encode(frame)) + list(stream.encode()):
            out.mux(packet)
    with pytest.raises(DecodeError, match="no video stream"):
        VideoClip(frames=2, size=8)({"mp4": VideoMember(buf.getvalue())})


def test_the_audio_of_the_clips_span_comes_with_it_when_asked_for():
    out = VideoClip(frames=5, stride=5, size=8, mode="center", audio=True, audio_rate=16000)(
        {"mp4": VideoMember(video_bytes("h264", frames=50, audio=True))})
    sound = out["mp4_audio"]
    assert sound.dtype == np.float32 and len(sound) == round(5 * 5 / 25 * 16000)
    assert 0.3 < float(np.abs(sound).max()) < 1.0  # the 440 Hz tone
    silent = VideoClip(frames=5, stride=5, size=8, audio=True)({"mp4": VideoMember(video_bytes("h264", frames=50))})
    assert not silent["mp4_audio"].any()


@pytest.mark.parametrize("codec", CODECS)
def test_the_loader_batches_clips_with_their_labels_times_and_rates(tmp_path, codec):
    """webdataset-written shards of videos, as users make them; each clip's frames belong to its own video (every
    video here starts at another grey level)."""
    import webdataset as wds

    d = tmp_path / "wds"
    d.mkdir()
    with wds.ShardWriter(str(d / "shard-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(8):
            sink.write({"__key__": f"{i:04d}", EXT[codec]: video_bytes(codec, frames=20), "cls": i})
    with StagingLoader(str(d / "shard-*.tar"), batch_size=4, workers=2, fields=[EXT[codec], "cls"],
                       transform=VideoClip(frames=4, stride=2, size=(12, 16))) as loader:
        batches = list(loader)
    assert sum(len(b["cls"]) for b in batches) == 8
    for b in batches:
        clips = b[EXT[codec]]
        assert clips.shape == (len(b["cls"]), 4, 12, 16, 3) and clips.dtype == torch.uint8
        assert b[f"{EXT[codec]}_time"].shape == (len(b["cls"]), 4) and torch.allclose(
            b[f"{EXT[codec]}_fps"], torch.tensor(25.0))
        for clip in clips:
            got = indices(clip.numpy())
            assert [g - got[0] for g in got] == [0, 2, 4, 6]


def test_the_same_seed_gives_the_same_clips_and_the_next_epoch_others(tmp_path):
    shards = shards_of(tmp_path, {f"v{i}": video_bytes("h264", frames=40) for i in range(4)})

    def epochs(seed):
        with StagingLoader(shards, batch_size=2, workers=2, seed=seed, fields=["mp4", "cls"],
                           transform=VideoClip(frames=3, stride=2, size=8)) as loader:
            return [{k: indices(c.numpy())[0] for b in loader for k, c in zip(b["__key__"], b["mp4"])}
                    for _ in range(2)]

    a, b = epochs(7), epochs(7)
    assert a == b and a[0] != a[1]


def test_decode_threads_a_worker_shrink_what_workers_auto_runs():
    from feedline.loader.tune import autotune

    one = autotune.choose("cpu", ranks_on_node=1, threads_per_worker=1)
    four = autotune.choose("cpu", ranks_on_node=1, threads_per_worker=4)
    assert four.most == max(1, (autotune.usable_cpus()[0] - 1) // 4) <= one.most
    assert VideoClip(threads=3).threads_per_worker == 3


def test_make_shards_packs_a_folder_of_class_folders_of_videos(tmp_path):
    src = tmp_path / "videos"
    for cls, n in (("cats", 2), ("dogs", 3)):
        (src / cls).mkdir(parents=True)
        for i in range(n):
            (src / cls / f"clip{i}.mp4").write_bytes(video_bytes("h264", frames=10))
    out = tmp_path / "shards"
    done = subprocess.run([sys.executable, "-m", "feedline", "make-shards", str(src), str(out), "--classes-from-folders"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "classes.txt").read_text().split() == ["cats", "dogs"]
    with StagingLoader(str(out / "*.tar"), batch_size=5, workers=1, fields=["mp4", "cls"],
                       transform=VideoClip(frames=2, size=8)) as loader:
        labels = sorted(c for b in loader for c in b["cls"].tolist())
    assert labels == [0, 0, 1, 1, 1]
