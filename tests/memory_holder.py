"""Run inside a sandbox: holds N MiB of random bytes (argv[1]) and, each
time /tmp/holder.ask appears, writes the SHA-256 of what it holds to
/tmp/holder.answer (first once at start). The memory tests and the
memory-snapshot rig ask it whether a restore brought every byte back."""
import hashlib
import os
import sys
import time

held = bytearray(int(sys.argv[1]) << 20)
for offset in range(0, len(held), 1 << 20):
    held[offset:offset + (1 << 20)] = os.urandom(1 << 20)


def answer():
    with open("/tmp/holder.answer.partial", "w") as out:
        out.write(hashlib.sha256(held).hexdigest())
    os.replace("/tmp/holder.answer.partial", "/tmp/holder.answer")


answer()
while True:
    if os.path.exists("/tmp/holder.ask"):
        os.unlink("/tmp/holder.ask")
        answer()
    time.sleep(0.02)
