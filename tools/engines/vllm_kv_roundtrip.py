"""Runs vLLM (CPU) with its MooncakeStoreConnector on a tiny local model and prints, as one JSON
line on stdout, what each generation of one prompt gave: the tokens the engine found cached
(num_cached_tokens) and the output tokens.

    python vllm_kv_roundtrip.py --model DIR --master-server-address unix:/PATH/mooncaked.sock \
        --phase roundtrip|once

- roundtrip: generate, drop vLLM's own prefix cache, generate again: the second run finds the
  prompt's full blocks through the connector, in the store.
- once: generate once. In a fresh process after another run, it loads what that run stored
  (the KV stays in the daemon after the process that stored it exits).

vLLM imports `mooncake.store`; with mooncaked's compatibility package installed, that is
mooncaked.mooncake_store, whose setup connects to the daemon at the master server address.
"""

import argparse
import json
import os
import tempfile

PROMPT = (
    "mooncaked keeps the KV cache of a prompt so that a second request can skip its prefill. "
    "An inference engine stores the key and value tensors of each block under a hash of its "
    "tokens. The store holds objects in shared memory segments and serves them over a Unix "
    "socket. Blocks of thirty-two tokens are written once and read by any engine process."
)
BLOCK_SIZE = 32


def write_store_config(args) -> str:
    """The JSON file vLLM reads from $MOONCAKE_CONFIG_PATH (vllm/distributed/mooncake_store.py)."""
    config = {
        "metadata_server": args.metadata_server,
        "master_server_address": args.master_server_address,
        "protocol": "tcp",
        "device_name": "",
        # vLLM requires a non-zero segment in its default (embedded) mode; mooncaked ignores it.
        "global_segment_size": "64MB",
        "local_buffer_size": "64MB",
    }
    fd, path = tempfile.mkstemp(prefix="mooncake-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a directory from tiny_model.py")
    parser.add_argument("--master-server-address", required=True,
                        help="mooncaked: unix:PATH or HOST:PORT of the daemon")
    parser.add_argument("--metadata-server", default="P2PHANDSHAKE",
                        help="only the real Mooncake uses it")
    parser.add_argument("--phase", choices=["roundtrip", "once"], default="roundtrip")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--reset-connector", action="store_true",
                        help="at the end, reset_prefix_cache(reset_connector=True): the "
                             "connector empties the store with remove_all(force=True)")
    args = parser.parse_args()

    config_path = write_store_config(args)
    # Set before vLLM is imported; the engine core process (spawned) inherits them.
    os.environ["MOONCAKE_CONFIG_PATH"] = config_path
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; nothing to download
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: a small machine
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

    import mooncake.store  # what vLLM's connector imports, in its worker process
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="bfloat16", block_size=BLOCK_SIZE, max_model_len=512,
              enforce_eager=True, seed=0,
              kv_transfer_config={"kv_connector": "MooncakeStoreConnector",
                                  "kv_role": "kv_both"})
    # Greedy and a fixed length: two runs with the same KV give the same tokens.
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    runs = []

    def generate() -> None:
        output = llm.generate([PROMPT], sampling, use_tqdm=False)[0]
        runs.append({
            "prompt_tokens": len(output.prompt_token_ids),
            "num_cached_tokens": output.num_cached_tokens,
            "output_token_ids": list(output.outputs[0].token_ids),
            "text": output.outputs[0].text,
        })

    generate()
    reset = None
    if args.phase == "roundtrip":
        # Clears vLLM's own prefix cache only (False if it could not): the second run can
        # then hit only through the connector, in the store.
        reset = llm.reset_prefix_cache()
        generate()
    connector_reset = None
    if args.reset_connector:
        connector_reset = llm.reset_prefix_cache(reset_connector=True)

    # Shut the engine down before reporting: the connector's close waits for pending puts.
    llm.llm_engine.engine_core.shutdown()
    os.unlink(config_path)
    print(json.dumps({
        "phase": args.phase,
        "vllm_version": vllm.__version__,
        "store_class": f"{mooncake.store.MooncakeDistributedStore.__module__}."
                       f"{mooncake.store.MooncakeDistributedStore.__qualname__}",
        "block_size": BLOCK_SIZE,
        "reset_prefix_cache": reset,
        "reset_connector": connector_reset,
        "runs": runs,
    }), flush=True)


if __name__ == "__main__":  # the engine spawns processes that import this module
    main()
