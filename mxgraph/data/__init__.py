"""Training data: what turns `--data` into this rank's batches.

The pipeline, in order:
1. source: no `--data` (the built-in standard-library text), a text file, a `.npy` of token
   ids, or documents (`.txt`, `.jsonl`, `.parquet`, a `save_to_disk` folder:
   `documents.py`);
2. documents -> token file: tokenized once with the run's tokenizer, written beside the data
   (`token_file.py`; `mxgraph data prepare` does it ahead of time: `mxgraph/cli/data.py`);
3. windows: packed documents (`packed.py`, `PackedBatches`) or random windows of raw tokens
   (`batches.py`, `Batches`);
4. loader: both follow one protocol (`loader.py`: `next`, `peek`, `state_dict`,
   `load_state_dict`); `training_data.py` makes the choice once for a run.

Part of the application layer (hf -> data -> train -> cli): it may import `mxgraph.hf` and
the compiler's public surface, and nothing in the compiler imports it.
"""
