"""Samples text from a trained run: aft-generate --workdir runs/x --prompt "The "

docs/training.md, "After training" and "Streams: no length limit" (--state, --save_state)."""

from __future__ import annotations

import argparse
import sys

from aft_jax import tools


def parse_args(argv=None) -> argparse.Namespace:
  p = tools.parser("generate", __doc__)
  p.add_argument("--prompt", default="", help="Text to continue ('': after an end of line).")
  p.add_argument("--prompt_file", help="Read the prompt from this UTF-8 file instead.")
  p.add_argument("--length", type=int, default=200, help="Tokens to generate (any number).")
  p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy.")
  p.add_argument("--top_k", type=int, default=0, help="The k most likely tokens (0: all).")
  p.add_argument("--top_p", type=float, default=1.0, help="Nucleus sampling's mass.")
  p.add_argument("--num_samples", type=int, help="Samples, one batch (default 1, or --state's).")
  p.add_argument("--stop_at_eos", action=argparse.BooleanOptionalAction, default=False)
  p.add_argument("--seed", type=int, help="Sampling seed (default 0, or --state's key goes on).")
  p.add_argument("--state", help="Continue the stream saved in this file (--save_state).")
  p.add_argument("--save_state", help="Write the stream's state to this file after the output.")
  return p.parse_args(argv)


def read_prompt(prompt: str, prompt_file: str | None) -> str:
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
  from aft_jax import decode, files  # pylint: disable=g-import-not-at-top

  if args.length < 1:
    raise ValueError(f"--length = {args.length} must be >= 1")
  if args.num_samples is not None and args.num_samples < 1:
    raise ValueError(f"--num_samples = {args.num_samples} must be >= 1")
  try:
    decode.check_sampling(args.temperature, args.top_k, args.top_p)
  except ValueError as e:
    raise ValueError(f"--{e}") from None
  if args.save_state is not None:
    files.check_file_path("--save_state", args.save_state)


def generate_main(args: argparse.Namespace) -> list[str]:
  """Prints and returns the samples, each with the prompt."""
  from aft_jax import decode, stream_file  # pylint: disable=g-import-not-at-top
  from aft_jax.model import STREAM  # pylint: disable=g-import-not-at-top
  from aft_jax.tools import trained  # pylint: disable=g-import-not-at-top

  check_args(args)
  prompt = read_prompt(args.prompt, args.prompt_file)
  config = trained.run_config(args.workdir, args.step)  # before anything slow
  flags = [f for f in ("--state", "--save_state") if getattr(args, f[2:]) is not None]
  if flags and not config.model.streams:
    cfg = config.model
    raise ValueError(
      f"{' and '.join(flags)}: the model of --workdir {args.workdir} (mixing {cfg.mixing!r}, "
      f"position embedding {cfg.position_embedding!r}) is no stream: only "
      f"{STREAM} keeps a state that does not grow"
    )
  run = trained.load_run(args.workdir, args.step, config=config)
  cfg = run.model.cfg
  stream, model_fingerprint = None, None
  if args.state is not None or args.save_state is not None:
    model_fingerprint = stream_file.fingerprint(cfg, run.params)
  if args.state is not None:
    stream = stream_file.load(args.state, run.model, model_fingerprint)
    rows = stream.last_B.shape[0]
    if args.num_samples not in (None, rows):
      raise ValueError(f"--num_samples = {args.num_samples}: --state {args.state} holds {rows}")
  ids, unknown = decode.encode_prompt(run.vocab, prompt)
  if unknown:
    print(
      f"note: {unknown} word(s) of the prompt are not in the vocabulary: read as <unk>",
      file=sys.stderr,
    )
  if not cfg.streams and len(ids) + args.length > cfg.max_len:
    print(
      f"note: the text passes max_len = {cfg.max_len} tokens: from there each token is "
      f"predicted from the last {cfg.max_len} only, re-encoded per token (a model with "
      "position_embedding 'none' streams instead)",
      file=sys.stderr,
    )
  options = ("temperature", "top_k", "top_p", "stop_at_eos", "seed")
  texts = decode.sample_texts(
    run.model,
    run.params,
    run.vocab,
    prompt,
    args.length,
    num_samples=args.num_samples or (1 if stream is None else stream.last_B.shape[0]),
    stream=stream,
    return_stream=args.save_state is not None,
    **{k: getattr(args, k) for k in options},
  )
  if args.save_state is not None:
    texts, after = texts
  samples = [prompt + t for t in texts]
  for i, s in enumerate(samples):
    if len(samples) > 1:
      print(f"--- sample {i + 1} of {len(samples)}")
    print(s)
  if args.save_state is not None:
    stream_file.save(args.save_state, after, model_fingerprint)
  return samples


def main(argv=None) -> None:
  tools.run_command("generate", generate_main, parse_args(argv))


if __name__ == "__main__":
  main()
