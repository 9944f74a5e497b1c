"""A parallel, chunked copier that writes into the final name, as AzCopy, aria2c
(--file-allocation=prealloc/trunc) and rclone's multi-thread --inplace copies do: the destination is
created at the source's full size first, then each chunk is written at its offset, in the order the
chunks' transfers complete (here: ORDER, comma-separated chunk numbers). After each chunk it prints
"chunk K" and, once STOP_AFTER chunks are written, waits on stdin (its parent SIGKILLs it there, as a
preempted node, an OOM kill or a Ctrl-C would).

  python chunkcopy.py SRC DST NCHUNKS ORDER STOP_AFTER
"""
import os, sys

src, dst, n, order, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
size = os.path.getsize(src)
chunk = -(-size // n)
fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644)
os.ftruncate(fd, size)
with open(src, "rb") as f:
    for done, k in enumerate(int(c) for c in order.split(",")):
        if done == stop:
            print("holding", flush=True)
            sys.stdin.read()
        f.seek(k * chunk)
        os.pwrite(fd, f.read(chunk), k * chunk)
        print(f"chunk {k}", flush=True)
os.close(fd)
print("done", flush=True)
