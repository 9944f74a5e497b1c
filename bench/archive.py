"""`python -m bench.archive`: uploading one many-shard checkpoint (~1 GiB: 16 shards of 64 MiB and
a few small files) to moto's S3 API server on 127.0.0.1, ckptd's archiver against boto3's own
`upload_file` of the same files, in the same run, alternately, each in a child process of its own
(so its peak RSS is its own).

- ckptd: `Archiver.archive` with concurrency 4, part_size 64 MiB: CRC32C computed while reading,
  each object's HEAD compared, the checkpoint listed again, the manifest written create-only.
- boto3: `client.upload_file` for each file, 4 files at once (a thread pool), TransferConfig with
  the same 64 MiB parts and no threads of its own per file; boto3's default checksum (CRC32).
Each repetition uploads into a fresh bucket, emptied afterwards (moto keeps objects in memory and
temporary files). Medians of REPS; the ratio is ckptd over boto3 (1.0: verification is free).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MiB = 1024 * 1024
SHARDS, SHARD = 16, 64 * MiB
REPS = 3
REPO = Path(__file__).resolve().parents[1]
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def _volume(root: Path) -> Path:
    ckpt = root / "run" / "checkpoint-100"
    (ckpt / "global_step100").mkdir(parents=True)
    block = os.urandom(MiB)
    for i in range(SHARDS):
        with open(ckpt / "global_step100" / f"bf16_zero_pp_rank_{i}_mp_rank_00_optim_states.pt", "wb") as f:
            for j in range(SHARD // MiB):
                f.write(block[j:] + block[:j])  # no two MiB alike
    for name in ("config.json", "trainer_state.json", "latest"):
        (ckpt / name).write_text("{}")
    return ckpt


def _client(endpoint: str):  # type: ignore[no-untyped-def]
    import boto3

    return boto3.session.Session(**{"aws_access_key_id": "bench", "aws_secret_access_key": "bench",
                                    "region_name": "us-east-1"}).client("s3", endpoint_url=endpoint)


def _child(side: str, ckpt: Path, endpoint: str, bucket: str) -> dict[str, float]:
    started = time.perf_counter()
    if side == "ckptd":
        from ckptd.archive.s3 import S3Store
        from ckptd.archive.upload import Archiver
        from ckptd.config.archive import Archive
        from ckptd.model import Check, Checkpoint, Verdict

        cfg = Archive(url=f"s3://{bucket}/archive", endpoint_url=endpoint, concurrency=4, part_size=64 * MiB)
        archiver = Archiver(cfg, S3Store(cfg), journal=None, state_dir=None)
        c = Checkpoint(ckpt.parent.parent, "run", ckpt.name, 100, "hf-trainer", (Check("bench", Verdict.PASSED, ""),))
        why = archiver.archive(c)
        assert why is None, why
    else:
        from boto3.s3.transfer import TransferConfig

        client = _client(endpoint)
        tc = TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB, use_threads=False)
        files = [p for p in ckpt.rglob("*") if p.is_file()]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda p: client.upload_file(str(p), bucket, f"raw/{p.relative_to(ckpt)}", Config=tc), files))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.archive", description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=4, metavar=("SIDE", "CKPT", "ENDPOINT", "BUCKET"), help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=REPS)
    args = p.parse_args()
    if args.child:
        side, ckpt, endpoint, bucket = args.child
        print(json.dumps(_child(side, Path(ckpt), endpoint, bucket)))
        return 0
    env = {**os.environ, **CREDS, "PYTHONPATH": os.pathsep.join([str(REPO)])}
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-archive-") as tmp:
        ckpt = _volume(Path(tmp))
        total = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        server = subprocess.Popen([sys.executable, "-m", "tests.support.motoserve"], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, env=env, cwd=REPO)
        try:
            assert server.stdout is not None
            endpoint = f"http://127.0.0.1:{int(server.stdout.readline())}"
            client = _client(endpoint)
            got: dict[str, list[dict[str, float]]] = {"ckptd": [], "boto3": []}
            for _ in range(args.reps):
                for side in ("boto3", "ckptd"):
                    bucket = f"bench-{uuid.uuid4().hex[:12]}"
                    client.create_bucket(Bucket=bucket)
                    out = subprocess.run([sys.executable, "-m", "bench.archive", "--child", side, str(ckpt),
                                          endpoint, bucket], env=env, cwd=REPO, capture_output=True, text=True,
                                         check=True)
                    got[side].append(json.loads(out.stdout.splitlines()[-1]))
                    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                        for o in page.get("Contents", []):
                            client.delete_object(Bucket=bucket, Key=o["Key"])
        finally:
            server.kill()
            server.wait()
    med = {s: statistics.median(r["seconds"] for r in rs) for s, rs in got.items()}
    rss = {s: max(r["maxrss_mib"] for r in rs) for s, rs in got.items()}
    mb = total / 1e6
    print(f"checkpoint: {SHARDS} x {SHARD // MiB} MiB shards + 3 small files = {total / MiB:.0f} MiB; "
          f"{args.reps} reps, medians")
    for s in ("ckptd", "boto3"):
        each = ", ".join(f"{r['seconds']:.2f}" for r in got[s])
        print(f"{s:>6}: {med[s]:.2f} s, {mb / med[s]:.0f} MB/s, peak RSS {rss[s]:.0f} MiB (each: {each} s)")
    print(f"ratio ckptd/boto3: {med['ckptd'] / med['boto3']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
