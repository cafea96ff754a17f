"""TorchServe serving MiniLM: build the archive, write config.properties, run it.

    python torchserve_server.py --model-dir DIR --port N --models a[,b,c] --threads T \
        --workers W --work DIR

In ``--work`` it builds one ``minilm.mar`` (torchserve_handler.py, minilm.py and
a peer_config.json naming the weights folder; the weights stay where they
are), writes ``config.properties`` and then becomes ``torchserve --start
--foreground``, so that the process the caller started is TorchServe's own
and its Java frontend and Python workers share its process group.

Every name in ``--models`` is registered from the same archive with W workers
(W processes, each T torch threads) and TorchServe's batching (batchSize 32,
maxBatchDelay ``--delay-ms``). Token auth, the model-control API, the metrics
API and system-metrics collection are off; TorchServe uploads nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from minilm import common_args, model_names, offline

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_archive(work: Path, model_dir: str, threads: int) -> Path:
    """``minilm.mar`` in ``work/model-store`` (torch-model-archiver, as documented)."""
    src = work / "mar-src"
    store = work / "model-store"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(store, ignore_errors=True)
    src.mkdir(parents=True)
    store.mkdir()
    (src / "peer_config.json").write_text(json.dumps({"model_dir": model_dir, "threads": threads}))
    shutil.copy(HERE / "minilm.py", src / "minilm.py")
    archiver = Path(sys.executable).parent / "torch-model-archiver"
    command = [str(archiver), "--model-name", "minilm", "--version", "1.0"]
    command += ["--handler", str(HERE / "torchserve_handler.py"), "--export-path", str(store)]
    command += ["--extra-files", f"{src / 'minilm.py'},{src / 'peer_config.json'}", "--force"]
    subprocess.run(command, check=True)
    return store


def write_config(work: Path, store: Path, names: list[str], args: argparse.Namespace) -> Path:
    workers = int(args.workers)
    settings = {
        "minWorkers": workers,
        "maxWorkers": workers,
        "batchSize": int(args.max_batch),
        "maxBatchDelay": round(args.delay_ms),
        "responseTimeout": 120,
    }
    models = {
        name: {"1.0": {"defaultVersion": True, "marName": "minilm.mar", **settings}}
        for name in names
    }
    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    lines = [
        f"inference_address=http://127.0.0.1:{args.port}",
        f"management_address=http://127.0.0.1:{free_port()}",
        f"metrics_address=http://127.0.0.1:{free_port()}",
        f"model_store={store}",
        "load_models=" + ",".join(f"{name}=minilm.mar" for name in names),
        f"models={json.dumps(models)}",
        f"default_workers_per_model={workers}",
        "disable_token_authorization=true",
        "enable_model_api=false",
        "enable_metrics_api=false",
        "disable_system_metrics=true",
        "install_py_dep_per_model=false",
        "job_queue_size=1000",
        f"vmargs=-XX:+ExitOnOutOfMemoryError -Djava.io.tmpdir={tmp}",
    ]
    path = work / "config.properties"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = common_args(__doc__ or "")
    parser.add_argument("--workers", type=int, default=1, help="worker processes per model")
    parser.add_argument("--work", required=True, help="folder for the archive, config and logs")
    args = parser.parse_args()
    offline()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    names = model_names(args.models)
    store = build_archive(work, str(Path(args.model_dir).resolve()), args.threads)
    config = write_config(work, store, names, args)
    # The pid file TorchServe keeps in the temp folder: ours alone, in the work folder.
    os.environ["TMPDIR"] = os.environ["TEMP"] = str(work / "tmp")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.chdir(work)  # its logs/ folder
    torchserve = str(Path(sys.executable).parent / "torchserve")
    command = [torchserve, "--start", "--foreground", "--ncs", "--disable-token-auth"]
    command += ["--ts-config", str(config), "--model-store", str(store)]
    sys.stdout.flush()
    os.execv(torchserve, command)


if __name__ == "__main__":
    main()
