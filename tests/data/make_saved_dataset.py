"""Writes tests/data/saved_dataset with Hugging Face `datasets` (not a test dependency: run
once by hand, `pip install datasets`, from the repository root):

    python tests/data/make_saved_dataset.py
"""
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import datasets  # noqa: E402

from tests.dataset_files import SAVED_DATASET, saved_dataset_documents  # noqa: E402

docs = saved_dataset_documents()
shutil.rmtree(SAVED_DATASET, ignore_errors=True)
table = {"title": [f"doc {i}" for i in range(len(docs))], "text": docs,
         "n": list(range(len(docs)))}
datasets.Dataset.from_dict(table).save_to_disk(str(SAVED_DATASET), num_shards=2)
print(datasets.__version__, sorted(p.name for p in SAVED_DATASET.iterdir()))
