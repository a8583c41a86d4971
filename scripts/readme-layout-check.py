#!/usr/bin/env python3
"""Fails when the README's layout table omits a module of src/ or a top-level folder.

Every file of src/, src/driver/, src/driver/sim/ and src/pool/ must be named in the table (a
top-level module as `src/NAME`, the others by file name in their folder's row), and every
top-level folder that git tracks as `NAME/`. CI runs it.
"""
import pathlib
import re
import subprocess
import sys

readme = pathlib.Path("README.md").read_text()
m = re.search(r"^## Layout\n(.*?)(?=^## )", readme, re.S | re.M)
if not m:
    sys.exit("readme-layout: no `## Layout` section in README.md")
table = m.group(1)
missing = []
for f in sorted(pathlib.Path("src").iterdir()):
    if f.is_file():
        stem, ext = f.stem, f.suffix
        # `src/kernels.{rs,cu,ptx}` names three files at once.
        if f"`src/{f.name}`" not in table and not re.search(rf"`src/{stem}\.\{{[^}}]*{ext[1:]}", table):
            missing.append(str(f))
    elif f"`src/{f.name}/`" not in table:
        missing.append(f"{f}/")
for d in ["src/driver", "src/driver/sim", "src/pool"]:
    for f in sorted(pathlib.Path(d).glob("*.rs")):
        if f"`{f.name}`" not in table and f"`{f.relative_to('src/driver')}`" not in table:
            missing.append(str(f))
tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout
top = sorted({p.split("/")[0] for p in tracked.splitlines() if "/" in p})
for d in top:
    if f"`{d}/" not in table:
        missing.append(f"{d}/")
if missing:
    print("readme-layout: the README's layout table does not name: " + ", ".join(missing))
    sys.exit(1)
print("readme-layout: OK")
