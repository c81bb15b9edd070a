"""Samples text from a trained run: aft-generate --workdir runs/x --prompt "The "

Loads the run's config, vocabulary (both kept in the workdir, so no dataset is needed) and its
latest (or --step) checkpoint, then decodes incrementally; past the model's max_len the context
slides (``aft_jax.decode``), so any --length is honoured. Prints the prompt and its
continuation; with --num_samples > 1 (sampled as one batch) each sample follows a header line.

A prompt is encoded like the corpus: bytes take any text; a word model maps words outside its
vocabulary to <unk> (and says how many on stderr), or refuses them if it has no <unk>.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="python -m aft_jax.tools.generate", description=__doc__.split("\n")[0]
  )
  p.add_argument("--workdir", required=True, help="A workdir written by train.py.")
  p.add_argument("--prompt", default="", help="Text to continue ('': after an end of line).")
  p.add_argument("--prompt_file", help="Read the prompt from this UTF-8 file instead.")
  p.add_argument("--length", type=int, default=200, help="Tokens to generate (any number).")
  p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy.")
  p.add_argument("--top_k", type=int, default=0, help="The k most likely tokens (0: all).")
  p.add_argument(
    "--top_p", type=float, default=1.0, help="Nucleus: the most likely tokens holding this mass."
  )
  p.add_argument("--num_samples", type=int, default=1, help="Samples, generated as one batch.")
  p.add_argument(
    "--stop_at_eos",
    action=argparse.BooleanOptionalAction,
    default=False,
    help="End each sample at its first end of line.",
  )
  p.add_argument("--seed", type=int, default=0, help="Sampling seed.")
  p.add_argument("--step", type=int, help="Checkpoint step (default: the latest).")
  return p.parse_args(argv)


def read_prompt(prompt: str, prompt_file: str | None) -> str:
  """--prompt, or the text of --prompt_file (one-line errors for a missing or non-UTF-8 file)."""
  if prompt_file is None:
    return prompt
  if prompt:
    raise ValueError("give --prompt or --prompt_file, not both")
  try:
    with open(prompt_file, encoding="utf-8") as f:
      return f.read()
  except OSError as e:
    raise ValueError(f"--prompt_file {prompt_file}: {e.strerror}") from None
  except UnicodeDecodeError as e:
    raise ValueError(f"--prompt_file {prompt_file} is not UTF-8 text ({e.reason})") from None


def check_args(args) -> None:
  from aft_jax import decode  # pylint: disable=g-import-not-at-top

  if args.length < 1:
    raise ValueError(f"--length = {args.length} must be >= 1")
  if args.num_samples < 1:
    raise ValueError(f"--num_samples = {args.num_samples} must be >= 1")
  try:
    decode.check_sampling(args.temperature, args.top_k, args.top_p)
  except ValueError as e:
    raise ValueError(f"--{e}") from None


def generate_main(args: argparse.Namespace) -> list[str]:
  """Runs the command: prints and returns the samples (each with the prompt)."""
  from aft_jax import decode  # pylint: disable=g-import-not-at-top
  from aft_jax.tools import trained  # pylint: disable=g-import-not-at-top
  from aft_jax.workdir import Workdir  # pylint: disable=g-import-not-at-top

  check_args(args)
  prompt = read_prompt(args.prompt, args.prompt_file)
  Workdir(args.workdir).check(args.step)  # before anything slow
  run = trained.load_run(args.workdir, args.step)
  _, unknown = decode.encode_prompt(run.vocab, prompt)
  if unknown:
    print(
      f"note: {unknown} word(s) of the prompt are not in the vocabulary: read as <unk>",
      file=sys.stderr,
    )
  options = ("num_samples", "temperature", "top_k", "top_p", "stop_at_eos", "seed")
  texts = decode.sample_texts(
    run.model, run.params, run.vocab, prompt, args.length, **{k: getattr(args, k) for k in options}
  )
  samples = [prompt + t for t in texts]
  for i, s in enumerate(samples):
    if len(samples) > 1:
      print(f"--- sample {i + 1} of {len(samples)}")
    print(s)
  return samples


def main(argv=None) -> None:
  """Console-script entry point (``aft-generate``); ``argv`` defaults to ``sys.argv[1:]``."""
  from aft_jax import tools  # pylint: disable=g-import-not-at-top

  tools.run_command("generate", generate_main, parse_args(argv))


if __name__ == "__main__":
  main()
