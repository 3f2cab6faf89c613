#!/usr/bin/env bash
# Fill the git-ignored .whl_rl/ folder with what verl's main_ppo needs on the H200 device machine
# beyond its image (KINDS.md's package list: torch 2.11, Triton 3.6, transformers 5.17, aiohttp,
# grpcio, prometheus-client, pandas, pyarrow, peft, ...) and beyond .whl/ (fetch_wheels.sh: verl
# 0.9.1, tensordict, hydra/omegaconf, datasets, codetiming, dill, ...), for cp312 manylinux x86_64.
# Versions are the ones .venv runs main_ppo with on CPU. Ray's wheel (79 MB) exceeds the device
# tool's 64 MiB carry, so it is repacked without what a single-node Python run never loads (see
# repack_ray below). Run here, then carry [".whl", ".whl_rl"] (scripts/device/grpo_h200.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
D=.whl_rl
rm -rf "$D" && mkdir -p "$D/tmp"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$1" "${@:2}"; }
get "$D/tmp" ray==2.60.0
# ray's own needs the image lacks (aiohttp & co, click, msgpack, protobuf, pyyaml, requests are there)
get "$D" jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
# verl[verl-core]'s imports on the main_ppo path: TransferQueue (and its zmq / msgspec), the
# stateful data loader, the agent loop's server types (fastapi -> pydantic, starlette,
# opentelemetry-api), uvicorn, cachetools, nvtx, pylatexenc; tensordict's importlib_metadata.
# Not brought: wandb / tensorboard loggers (console + file here), torchcodec, qwen_vl_utils and
# mathruler (vision and math-verify paths), pytest plugins, ray[default]'s dashboard extras
# (aiohttp_cors, opencensus, ...: without them Ray starts no dashboard, which main_ppo never reads).
get "$D" TransferQueue==0.1.11 pyzmq==27.3.0 msgspec==0.23.0 torchdata==0.11.0 \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 opentelemetry-api==1.45.2 importlib_metadata==10.2.0 uvicorn==0.54.0 \
  cachetools==8.0.2 nvtx==0.2.17 pylatexenc==2.11

# Ray without its Java jars (32 MB), the dashboard's web client build, and the libraries built on
# Ray (rllib, tune, train, serve, data, llm: verl imports ray, ray.actor, ray.util.*,
# ray.experimental.state and ray._private only); its three native programs without their symbol
# tables (strip: the dynamic symbols stay). RECORD is rewritten with the new hashes so pip
# installs it as a regular wheel.
python3 - "$D/tmp"/ray-2.60.0-*.whl "$D" <<'EOF'
import base64, csv, hashlib, io, os, shutil, subprocess, sys, tempfile, zipfile

src, out_dir = sys.argv[1], sys.argv[2]
DROP = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/tune/", "ray/train/", "ray/serve/",
        "ray/data/", "ray/llm/")
STRIP = ("ray/_raylet.so", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet")
zin = zipfile.ZipFile(src)
# the wheel's own RECORD (top level); Ray vendors other packages' dist-info folders under ray/
record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1)
dst = os.path.join(out_dir, os.path.basename(src))
rows = []
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        name = info.filename
        if name == record_name or name.startswith(DROP):
            continue
        data = zin.read(info)
        if name in STRIP and shutil.which("strip"):
            with tempfile.NamedTemporaryFile(delete=False) as f:
                f.write(data)
            subprocess.run(["strip", "--strip-unneeded", f.name], check=True)
            with open(f.name, "rb") as f2:
                data = f2.read()
            os.unlink(f.name)
        zi = zipfile.ZipInfo(name, date_time=info.date_time)
        zi.external_attr, zi.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
        zout.writestr(zi, data, compresslevel=9)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append((name, f"sha256={digest}", len(data)))
    rows.append((record_name, "", ""))
    record = io.StringIO()
    csv.writer(record, lineterminator="\n").writerows(rows)
    zi = zipfile.ZipInfo(record_name, date_time=zin.getinfo(record_name).date_time)
    zi.external_attr = zin.getinfo(record_name).external_attr
    zout.writestr(zi, record.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
print(f"{dst}: {os.path.getsize(src) / 1e6:.1f} MB -> {os.path.getsize(dst) / 1e6:.1f} MB")
EOF
rm -rf "$D/tmp"
ls -la "$D"
du -cb "$D"/*.whl | tail -1
