"""Files as the real writers make them, for the format tests: run by .venv-peers's Python (tensorflow-cpu,
Hugging Face datasets), never imported by the tests' own process.

    python tests/peer_writer.py tfrecord OUT [--gzip DIR]   # TensorFlow's TFRecordWriter: part-NNN.tfrecord,
                                                            # and the same records GZIP'd in DIR/part-NNN.tfrecord.gz
    python tests/peer_writer.py parquet OUT             # Hugging Face datasets' to_parquet: part-NNN.parquet

Each writes ``OUT/given.json`` too: what the writer was given, record by record, for the tests to compare
every field with.
"""

import argparse
import base64
import contextlib
import io
import json
import os

import numpy as np
from PIL import Image


def jpeg(rng: np.random.Generator) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def tfrecord(out: str, shards: int, per_shard: int, gzip: str | None) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up notices on stderr
    import tensorflow as tf

    rng = np.random.default_rng(7)
    given = {}
    for s in range(shards):
        name = f"part-{s:03d}.tfrecord"
        records = []
        with contextlib.ExitStack() as stack:
            writers = [stack.enter_context(tf.io.TFRecordWriter(os.path.join(out, name)))]
            if gzip:
                os.makedirs(gzip, exist_ok=True)
                writers.append(stack.enter_context(tf.io.TFRecordWriter(
                    os.path.join(gzip, name + ".gz"), tf.io.TFRecordOptions(compression_type="GZIP"))))
            for i in range(per_shard):
                n = s * per_shard + i
                image = jpeg(rng)
                boxes = rng.random(4 * (n % 4)).astype(np.float32)  # 0 to 3 boxes: a variable-length list
                tokens = rng.integers(0, 50000, 8)
                tags = [f"tag{n % 3}".encode(), f"tag{n % 5}".encode()]
                feature = {
                    "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
                    "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[n])),
                    "image/object/bbox": tf.train.Feature(float_list=tf.train.FloatList(value=boxes.tolist())),
                    "tokens": tf.train.Feature(int64_list=tf.train.Int64List(value=tokens.tolist())),
                    "caption": tf.train.Feature(bytes_list=tf.train.BytesList(value=[f"a photo, {n}".encode()])),
                    "tags": tf.train.Feature(bytes_list=tf.train.BytesList(value=tags)),
                    "score": tf.train.Feature(float_list=tf.train.FloatList(value=[n / 7])),
                }
                for writer in writers:
                    writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
                records.append({"image/encoded": base64.b64encode(image).decode(), "image/class/label": n,
                                "image/object/bbox": boxes.tolist(), "tokens": tokens.tolist(),
                                "caption": f"a photo, {n}", "tags": [t.decode() for t in tags], "score": n / 7})
        given[name] = records
    return {"tensorflow": tf.__version__, "files": given}


def parquet(out: str, shards: int, per_shard: int) -> dict:
    import datasets

    rng = np.random.default_rng(11)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=1000),
                                  "caption": datasets.Value("string"),
                                  "tokens": datasets.Sequence(datasets.Value("int64")),
                                  "score": datasets.Value("float32")})
    given = {}
    for s in range(shards):
        rows = []
        for i in range(per_shard):
            n = s * per_shard + i
            rows.append({"image": jpeg(rng), "label": n, "caption": f"a photo, {n}",
                         "tokens": rng.integers(0, 50000, 1 + n % 5).tolist(), "score": n / 7})
        columns = {k: [{"bytes": r[k], "path": None} if k == "image" else r[k] for r in rows] for k in rows[0]}
        name = f"part-{s:03d}.parquet"
        datasets.Dataset.from_dict(columns, features=features).to_parquet(os.path.join(out, name))
        given[name] = [{**r, "image": base64.b64encode(r["image"]).decode()} for r in rows]
    return {"datasets": datasets.__version__, "files": given}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("format", choices=("tfrecord", "parquet"))
    p.add_argument("out")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--per-shard", type=int, default=12)
    p.add_argument("--gzip", help="tfrecord: the same records with TFRecordOptions(compression_type='GZIP') there")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    doc = (tfrecord(a.out, a.shards, a.per_shard, a.gzip) if a.format == "tfrecord"
           else parquet(a.out, a.shards, a.per_shard))
    with open(os.path.join(a.out, "given.json"), "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main()
