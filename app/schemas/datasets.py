"""The types of /datasets (app/api/routes/datasets.py): a dataset's description (its meta.json) and the
OpenAPI description of the upload's multipart body."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

from datadir import NAME_PATTERN
from datadir.datasets import DATASET_KINDS, LISTED_LABELS
from datadir.jobs import LEGACY_OWNER

# POST /datasets is parsed by app/jobs/uploads.py as it streams in, so FastAPI never sees a body model;
# this is its OpenAPI description.
DATASET_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "corpus: .txt or .jsonl (a 'text' field); labelled: .csv, .tsv or .jsonl "
                            "with 'text' and 'label' (and optionally 'text_pair'); token-labelled: CoNLL "
                            "columns (.conll, .iob, .iob2, .bio, .txt, .tsv) or .jsonl with 'tokens' and "
                            "'tags' (IOB2); qa: SQuAD v1.1/v2.0 .json; pairs: .csv, .tsv or .jsonl with "
                            "'anchor', 'positive' and optionally 'negative' or 'negative_1'..'negative_n'; "
                            "scored-pairs: .csv, .tsv or .jsonl with 'sentence1', 'sentence2' and 'score' (0..1); "
                            "retrieval (evaluation only): a .zip, .tar.gz, .tgz or .tar of a BEIR folder "
                            "(corpus.jsonl, queries.jsonl, qrels.tsv or qrels/<split>.tsv), or one .jsonl of "
                            "documents {'_id', 'text'} and queries {'query', 'positive_ids'}",
                        },
                        "name": {
                            "type": "string",
                            "pattern": NAME_PATTERN,
                            "description": "Default: the file name without its suffix.",
                        },
                        "kind": {
                            "type": "string",
                            "enum": list(DATASET_KINDS),
                            "description": "Default: from the extension and the columns (a .jsonl's first "
                            "record): .csv and .tsv are pairs with 'anchor' and 'positive', scored-pairs with "
                            "'sentence1', 'sentence2' and 'score', else labelled; .jsonl is also "
                            "token-labelled with 'tokens' and 'tags', retrieval with 'query' and "
                            "'positive_ids', else corpus; .txt is corpus; an archive is retrieval.",
                        },
                    },
                }
            }
        },
    }
}

DatasetKind = Literal["corpus", "labelled", "token-labelled", "qa", "pairs", "scored-pairs", "retrieval"]
assert set(get_args(DatasetKind)) == set(DATASET_KINDS)


class DatasetInfo(BaseModel):
    name: str
    kind: DatasetKind
    format: str
    file: str = Field(description="The data file in the dataset's folder; `data`, a folder, for a retrieval archive.")
    original_filename: str
    bytes: int = Field(description="The size of the file as uploaded.")
    sha256: str
    created_at: str
    owner: str = Field(
        LEGACY_OWNER,
        description="The name of the key that uploaded it (`admin` for datasets from before keys had names).",
    )
    shared: bool = Field(
        True, description="Every key may train on it: an admin uploaded it. Else only its owner (and admins) see it."
    )
    documents: int | None = Field(None, description="A corpus's documents; a retrieval set's corpus documents.")
    sentences: int | None = None
    rows: int | None = None
    num_labels: int | None = Field(
        None,
        description=f"Distinct labels (tags); `labels` and the counts list at "
        f"most {LISTED_LABELS} of them, the most frequent.",
    )
    labels: list[str] | None = None
    label_counts: dict[str, int] | None = None
    is_pair: bool | None = None
    tokens: int | None = None
    entity_counts: dict[str, int] | None = None
    questions: int | None = None
    impossible: int | None = None
    contexts: int | None = None
    negatives: int | None = Field(None, description="Pairs: the hard negatives of each row.")
    ids: bool | None = Field(None, description="Pairs: whether rows carry an `id`.")
    distinct_anchors: int | None = None
    mean_chars: dict[str, float] | None = Field(
        None, description="Pairs and scored pairs: the mean characters of each text column (`negative`: all negatives)."
    )
    mean_score: float | None = None
    queries: int | None = Field(None, description="Retrieval: the queries its split judges.")
    judgements: int | None = Field(None, description="Retrieval: the relevant (query, document) pairs of its split.")
    split: str | None = Field(None, description="Retrieval: the split evaluated unless a job names one.")
    splits: list[str] | None = Field(None, description="Retrieval: every judged split (each checked at upload).")
    disk_bytes: int | None = Field(None, description="Bytes on disk: the file, meta.json and token caches.")


class DatasetsResponse(BaseModel):
    datasets: list[DatasetInfo]
