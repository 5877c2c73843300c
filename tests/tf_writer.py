"""TFRecord files as TensorFlow writes them: run by .venv-peers's Python (tensorflow-cpu), never imported by the
tests' own process. Writes ``<out>/part-NNN.tfrecord`` (``.tfrecord.gz`` with --gzip) and ``<out>/given.json``:
what the writer was given, record by record, for the tests to compare every field with.

    python tests/tf_writer.py OUT [--shards 2] [--per-shard 12] [--gzip]
"""

import argparse
import base64
import io
import json
import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up notices on stderr
import tensorflow as tf  # noqa: E402
from PIL import Image  # noqa: E402


def jpeg(rng: np.random.Generator) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--per-shard", type=int, default=12)
    p.add_argument("--gzip", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(7)
    given = {}
    options = tf.io.TFRecordOptions(compression_type="GZIP" if a.gzip else "")
    for s in range(a.shards):
        name = f"part-{s:03d}.tfrecord" + (".gz" if a.gzip else "")
        records = []
        with tf.io.TFRecordWriter(os.path.join(a.out, name), options) as writer:
            for i in range(a.per_shard):
                n = s * a.per_shard + i
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
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
                records.append({"image/encoded": base64.b64encode(image).decode(), "image/class/label": n,
                                "image/object/bbox": boxes.tolist(), "tokens": tokens.tolist(),
                                "caption": f"a photo, {n}", "tags": [t.decode() for t in tags], "score": n / 7})
        given[name] = records
    with open(os.path.join(a.out, "given.json"), "w") as f:
        json.dump({"tensorflow": tf.__version__, "files": given}, f)


if __name__ == "__main__":
    main()
