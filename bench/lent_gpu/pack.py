"""Pack results/runs/ROW for the rows given into at most 6 gzipped tars under OUT (58 MiB in all; a call
returns at most 64 MiB in 8 files):
finished rows first without their checkpoints/, then unfinished ones with them (to resume)."""
import io
import os
import sys
import tarfile

out, rows = sys.argv[1], sys.argv[2:]
runs = "results/runs"
present = [r for r in os.listdir(runs) if os.path.isdir(os.path.join(runs, r))] if os.path.isdir(runs) else []
order = [r for r in dict.fromkeys(rows) if r in present]  # a row may be given again as a stage of another
finished = [r for r in order if os.path.exists(os.path.join(runs, r, "linjax.json"))]
unfinished = [r for r in order if r not in finished]
LIMIT, TOTAL = 15 * 2**20, 58 * 2**20
blobs = []
for row, keep_checkpoints in [(r, False) for r in finished] + [(r, True) for r in unfinished]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(os.path.join(runs, row), arcname=os.path.join(runs, row),
                filter=lambda t: None if not keep_checkpoints and "/checkpoints" in t.name else t)
    blobs.append((row, buf.getvalue()))
groups, total = [[]], 0
for row, data in blobs:
    if total + len(data) > TOTAL or len(data) > LIMIT:
        print("left out:", row, len(data))
        continue
    if sum(len(d) for _, d in groups[-1]) + len(data) > LIMIT:
        if len(groups) == 6:
            print("left out:", row, len(data))
            continue
        groups.append([])
    groups[-1].append((row, data))
    total += len(data)
for i, group in enumerate(groups):
    with open(os.path.join(out, f"runs{i}.tar"), "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
        for row, data in group:
            info = tarfile.TarInfo(f"{row}.tar.gz")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    print(f"runs{i}.tar:", [row for row, _ in group])
with tarfile.open(os.path.join(out, "logs.tar.gz"), "w:gz") as tar:
    for path in ("runs/claims-logs", os.path.join(out, "claims.log"), os.path.join(out, "progress.log")):
        if os.path.exists(path):
            tar.add(path, arcname=os.path.basename(path))
for name in ("claims.log", "progress.log"):
    if os.path.exists(os.path.join(out, name)):
        os.remove(os.path.join(out, name))
