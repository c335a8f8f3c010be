"""`python -m zipfusion_jax.generate`: the argument contract, JSON output, and clear failures (in-process, tiny random models)."""

import json

import pytest

from zipfusion_jax.generate import main, parse_args

TINY = ["--model", "tiny-llama3", "--random-weights"]


def test_defaults():
  args = parse_args(["--prompt", "hi"])
  assert (args.kv, args.model, args.gguf, args.safetensors, args.temperature, args.chat) == (
      "compressed", None, None, None, 0.0, False)
  with pytest.raises(SystemExit):
    parse_args(["--prompt", "hi", "--kv", "zip"])
  with pytest.raises(SystemExit):
    parse_args(["--prompt", "hi", "--gguf", "a.gguf", "--safetensors", "dir"])


def test_batch_json(tmp_path, capsys):
  out = tmp_path / "out.json"
  rc = main([*TINY, "--prompt", "abc", "--prompt", "hello there", "--max-new-tokens", "5", "--max-batch", "1",
             "--kv", "uncompressed", "--json", str(out)])
  assert rc == 0
  payload = json.loads(out.read_text())
  results = payload["results"]
  assert [r["prompt"] for r in results] == ["abc", "hello there"]
  assert results[0]["prompt_ids"] == list(b"abc")
  assert all(len(r["token_ids"]) == 5 and isinstance(r["text"], str) for r in results)
  assert payload["stats"]["new_tokens"] == 10 and payload["stats"]["kv"] == "uncompressed"
  assert payload["stats"]["tokens_per_s"] > 0
  assert "--- abc" in capsys.readouterr().out
  assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left behind


def test_batching_and_sampling_are_reproducible(tmp_path):
  def run(*extra):
    out = tmp_path / "o.json"
    assert main([*TINY, "--prompt", "xy", "--prompt", "zzz", "--max-new-tokens", "4", "--json", str(out), *extra]) == 0
    return [r["token_ids"] for r in json.loads(out.read_text())["results"]]

  together = run()
  assert run("--max-batch", "1") == together  # greedy slots do not disturb each other
  sampled = run("--temperature", "1.5", "--seed", "7")
  assert run("--temperature", "1.5", "--seed", "7") == sampled


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt-5"], "unknown model 'gpt-5'"),
        (["--model", "llama3.1-8b"], "no weights ship"),
        ([*TINY, "--max-new-tokens", "300"], "exceeds the context"),
        ([*TINY, "--kv-memory-mib", "0.01"], "--kv-memory-mib"),
        ([*TINY, "--chat"], "no chat template"),
        (["--gguf", "/nonexistent/model.gguf"], "no such GGUF file"),
    ],
)
def test_errors_are_clear_and_write_nothing(tmp_path, capsys, argv, message):
  out = tmp_path / "out.json"
  assert main(["--prompt", "hi", *argv, "--json", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and message in err
  assert not any(tmp_path.iterdir())


def test_corrupted_safetensors_checkpoint(tmp_path, capsys):
  import jax

  from models import get_config
  from models.loaders.safetensors_checkpoint import save_safetensors
  from models.params import random_params

  config = get_config("tiny-qwen3")
  ckpt = tmp_path / "ckpt"
  save_safetensors(str(ckpt), config, random_params(config, jax.random.key(0)))
  (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:1000])
  assert main(["--prompt", "hi", "--safetensors", str(ckpt), "--json", str(tmp_path / "o.json")]) == 2
  err = capsys.readouterr().err
  assert "model.safetensors" in err and not (tmp_path / "o.json").exists()


def test_kvstats_missing_text(tmp_path, capsys):
  from zipfusion_jax.kvstats import main as kvstats_main

  assert kvstats_main(["--text", str(tmp_path / "missing.txt")]) == 2
  assert "missing.txt" in capsys.readouterr().err


@pytest.mark.parametrize("mib", ["inf", "nan", "0", "-1"])
def test_kv_memory_budget_must_be_positive_and_finite(capsys, mib):
  with pytest.raises(SystemExit) as e:  # inf used to escape as an OverflowError traceback
    parse_args(["--prompt", "hi", "--kv-memory-mib", mib])
  assert e.value.code == 2 and "--kv-memory-mib must be a finite number > 0" in capsys.readouterr().err


def test_demo_needs_one_complete_page(capsys):
  from zipfusion_jax.demo import main as demo_main

  with pytest.raises(SystemExit) as e:  # fewer than 16 tokens used to fail deep inside with a traceback
    demo_main(["--tokens", "10"])
  assert e.value.code == 2 and "--tokens must be >= 16" in capsys.readouterr().err
