"""Write tests/data/minilm_golden.json: the text model's reference vectors, computed once by
its reference implementation (sentence-transformers reading the same files from the model's
wheel) for every text the tests compare against it. The tests read the file and never import
sentence-transformers, so CI need not install it (with transformers, scipy, scikit-learn).

    .venv/bin/python -m pip install "redbatch[reference]"   # sentence-transformers
    cd tests && ../.venv/bin/python make_minilm_golden.py

Each vector is 384 float32 values, L2-normalised (``normalize_embeddings=True``), stored as
base64 of their little-endian bytes, keyed by the text itself.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
from test_text_model import LONG, PARAPHRASES, SENTENCES

OUT = Path(__file__).resolve().parent / "data" / "minilm_golden.json"
#: The texts the tests look up, in a stable order.
TEXTS = list(dict.fromkeys([*SENTENCES, "Yes.", LONG, "Call me Ishmael.",
                            "A man is eating food.", *(t for row in PARAPHRASES for t in row)]))


def main() -> None:
    from redbatch.handlers.text import model_dir
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir()), device="cpu")
    vectors = np.asarray(model.encode(TEXTS, normalize_embeddings=True), dtype="<f4")
    golden = {"reference": "sentence-transformers, normalize_embeddings=True",
              "dim": int(vectors.shape[1]),
              "vectors": {text: base64.b64encode(v.tobytes()).decode("ascii")
                          for text, v in zip(TEXTS, vectors, strict=True)}}
    OUT.write_text(json.dumps(golden, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {len(TEXTS)} vectors to {OUT}")


if __name__ == "__main__":
    main()
