"""The config reference: every key of every table, its default and its meaning, as Markdown.

The README's "Config reference" section is this text; `tests/core/test_reference.py` fails when
they differ, or when a config field has no meaning here, so the reference never drifts from
`Config`. Print it with `python -m zephon_stream.loader.reference`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from zephon_stream.loader.config import Config, ScheduleEntry, SourceConfig, TransformStep, VisionConfig

__all__ = ["EXECUTION", "MEANINGS", "config_reference", "undocumented"]

#: keys that only decide how fast the same samples come (the rest shape the samples: a checkpoint
#: refuses to load under other values of those)
EXECUTION = {("", k) for k in ("backend", "workers", "cpu_threads", "max_restarts", "ray_address", "ray_actors",
                               "ray_num_cpus", "tokenize_batch", "doc_buffer", "sample_buffer", "sample_batch",
                               "read_ahead", "stall_warning_s")} | {
    ("sources", k) for k in ("endpoint_url", "region", "addressing_style", "profile", "connect_timeout",
                             "read_timeout", "max_attempts", "retry_deadline")} | {
    ("vision", "decode_batch"), ("vision", "decode_ahead"), ("vision", "decode_threads"),
    ("vision", "decode_processes")}

#: (table, key) -> meaning. `table` is "" for top-level keys.
MEANINGS: dict[tuple[str, str], str] = {
    ("", "seed"): "Seeds every permutation, shuffle and tie-break. ",
    ("", "lanes"): "The number of independent lanes L; fixed for a run, independent of the number of GPUs "
                   "(dp_size must divide it). ",
    ("", "seq_len"): "Tokens per sample. ",
    ("", "global_batch_size"): "Samples per optimizer step, all ranks together. ",
    ("", "tokenizer"): "Path of a Hugging Face `tokenizers` JSON file, or of a model directory that holds "
                       "`tokenizer.json` (relative to the config file). Its SHA-256 is an order setting.",
    ("", "sources"): "The `[[sources]]` tables (below).",
    ("", "eos_token"): "Appended after every document. ",
    ("", "bos_token"): "Put before every document, for tokenizers that want one; off when unset. ",
    ("", "labels"): '`"shifted"`: `labels[t]` is the target of position t (torchtitan, Megatron); '
                    '`"unshifted"`: aligned with `input_ids`, the model shifts (Hugging Face). ',
    ("", "pad_token_id"): "The id that pads samples; unset: the EOS id. ",
    ("", "shuffle_window"): "Documents in each lane's shuffle window; it grows by one document a pull until "
                            "full, so the first samples need a few documents, not a window; 0 = off. ",
    ("", "shuffle_scope"): '`"lane"`: one window after the mix; `"source"`: one per source before it, so '
                           "realized shares follow a weight change within a few steps. ",
    ("", "piece_tokens"): "Text documents longer than this many tokens are cut into pieces of it as they are "
                          "read, before the shuffle and the mix, so realized shares hold over short spans "
                          "whatever the documents' lengths (image documents stay whole); 0 = off. ",
    ("", "max_epochs"): "0 = forever; N = every source's documents appear exactly N times, then the lanes "
                        "end. ",
    ("", "mix"): '`"tokens"`: the mix tracks the weights in tokens; `"documents"`: in documents. ',
    ("", "mask_cross_document_labels"): "Label -100 at a document's last token (no target across documents). ",
    ("", "split_bytes"): "The largest split: sources are cut into k x lanes splits of about equal bytes, the "
                         "fewest that keep them under this. ",
    ("", "on_bad_record"): '`"error"`: a bad record stops the loader with a DataError naming the object and '
                           'offset; `"skip"`: it is skipped and counted. ',
    ("", "max_record_bytes"): "The largest record (or tar member); a longer one is a bad record. ",
    ("", "backend"): '`"inline"`, `"threads"`, `"processes"` or `"ray"`: where lanes run. ',
    ("", "workers"): "Worker processes per rank (processes backend). ",
    ("", "cpu_threads"): "Threads for CPU steps (decode, tokenize) per process. ",
    ("", "max_restarts"): "Restarts of a lane worker (process or Ray actor) that died before the loader "
                          "fails. ",
    ("", "ray_address"): "Ray backend: an existing cluster's address; unset: start a local Ray on 127.0.0.1. ",
    ("", "ray_actors"): "Ray backend: actors this rank's lanes are spread over. ",
    ("", "ray_num_cpus"): "Ray backend: CPUs each actor reserves. ",
    ("", "tokenize_batch"): "Documents per tokenizer call. ",
    ("", "doc_buffer"): "Tokenized document batches buffered per source per lane. ",
    ("", "sample_buffer"): "Sample batches buffered per lane. ",
    ("", "sample_batch"): "Samples per lane-to-sequencer hand-off (fewer once they hold 1 MiB: samples with "
                          "images go one by one). ",
    ("", "read_ahead"): "Ranged reads (up to 1 MiB) of a split in flight per lane, on a store with a round trip a "
                        "request (S3); 1 = one at a time. Local files and `memory://` are always read one part at a "
                        "time (the kernel reads ahead; a window there cost the image bench 5-10%). ",
    ("", "stall_warning_s"): "Seconds a batch may wait for one lane's samples before a warning names the lane "
                             "(again at each multiple, and once more when they come); 0 = never. ",
    ("", "vision"): "The `[vision]` table (below); needed by sources with `image_field`.",
    ("", "schedule"): "The `[[schedule]]` tables (below).",
    ("", "packing"): '`"concat"`: concatenate documents and cut every seq_len tokens; `"best_fit"`: whole '
                     'documents, chosen best-fit from a window, padded (a longer one is cut from its end into '
                     'whole seq_len pieces and a leftover); `"none"`: one document per sample, padded (a longer one '
                     "is split into seq_len pieces). No token is dropped unless `truncate`. ",
    ("", "packing_window"): '`packing = "best_fit"`: documents per lane that each sample is filled from. ',
    ("", "truncate"): '`packing = "none"`: cut a longer document at seq_len (counted in statistics) instead of '
                      "splitting it. ",
    ("sources", "name"): "The source's name, unique: in schedules, statistics and digests.",
    ("sources", "uri"): "`file:///abs/dir/`, `s3://bucket/prefix/`, or a plain path (relative to the config "
                        "file; in a `Config` made in Python, to the working directory): every shard under it, "
                        "sorted by key. ",
    ("sources", "weight"): "The source's share of the mix; weights are relative (0.7 and 0.3 = 7 and 3); 0 "
                           "pauses the source until every weighted one has ended. ",
    ("sources", "text_field"): "The JSON key or Parquet column that holds the text, else a dotted path into "
                               "nested objects or structs (`doc.body`); for an image source the tar member "
                               "(`txt`, `json:caption`, `json:meta.caption`). ",
    ("sources", "image_field"): "Makes it an image+text source: the tar member extensions (`png`, "
                                "`jpg;jpeg;png`; a sample's first of them is its image) or Parquet column that "
                                "hold the image. With it, set `text_field` too (`txt`, as `zephon shard` writes): its "
                                "default, `text`, is a JSON key. ",
    ("sources", "messages_field"): "Makes it a chat source: the field that holds a conversation, a list of "
                                   "`{role, content}` messages (OpenAI / Hugging Face style). ",
    ("sources", "chat_template"): "Chat sources: a Jinja chat template file (relative to the config file); "
                                  "unset: the model directory's, as transformers finds it (`chat_template.jinja`, "
                                  "else the `chat_template` of the `tokenizer_config.json` next to the tokenizer). ",
    ("sources", "loss_on"): 'Chat sources: the tokens trained on, `"assistant"` (every assistant message), '
                            '`"last_assistant"` or `"all"`; labels are -100 elsewhere. ',
    ("sources", "chat_template_kwargs"): "Chat sources: extra template variables, as `apply_chat_template(**kwargs)` "
                                         "passes them (`{ enable_thinking = false }`). ",
    ("sources", "tools_field"): "Chat sources: the field that holds the tools the conversation may call (a list "
                                "of JSON-schema function specs, or a JSON string of one), the template's `tools`. ",
    ("sources", "documents_field"): "Chat sources: the field that holds the documents retrieved for the "
                                    "conversation (a list of objects such as `{title, text}`, or a JSON string of "
                                    "one), the template's `documents`, for retrieval-augmented training. ",
    ("sources", "transforms"): "`[[sources.transforms]]` steps (below), applied to each record in order "
                               "before tokenizing. ",
    ("sources", "endpoint_url"): "S3: the endpoint (http://host:port). ",
    ("sources", "region"): "S3: the region. ",
    ("sources", "addressing_style"): 'S3: `"auto"`, `"path"` or `"virtual"`. ',
    ("sources", "profile"): "S3: a profile of the AWS config files (`~/.aws/config`, `~/.aws/credentials`) "
                            "for this source's credentials; unset: the environment's (AWS_PROFILE, keys, "
                            "instance role). ",
    ("sources", "connect_timeout"): "S3: seconds to connect, per request. ",
    ("sources", "read_timeout"): "S3: seconds between bytes of a response. ",
    ("sources", "max_attempts"): "S3: attempts of one request (refused or dropped connections, 5xx, throttling, "
                                 "timeouts: botocore's standard retries, with backoff). ",
    ("sources", "retry_deadline"): "S3: seconds an outage is ridden out: once the endpoint has answered, a request "
                                   "that failed all its attempts is tried again until then (not a timeout). ",
    ("vision", "patch_size"): "Pixels on a patch side. ",
    ("vision", "merge_size"): "Patches per side merged into one image token. ",
    ("vision", "temporal_patch_size"): "Frames per patch (a still image is repeated). ",
    ("vision", "min_pixels"): "The fewest pixels a resized image has. ",
    ("vision", "max_pixels"): "The most pixels a resized image has; with seq_len, one image must fit in a "
                              "sample. ",
    ("vision", "max_decoded_pixels"): "A source image with more pixels (from its header) is refused before "
                                      "decoding, as a decompression bomb. ",
    ("vision", "image_token"): "The placeholder token, one per merged patch; must be in the vocabulary. ",
    ("vision", "vision_start_token"): "Before each image's placeholders; optional. ",
    ("vision", "vision_end_token"): "After each image's placeholders; optional. ",
    ("vision", "pixel_dtype"): '`"uint8"`: raw pixels (normalise on the device with '
                               '`zephon_stream.vision.normalize`); `"float32"`: normalised on the host. ',
    ("vision", "decode_batch"): "Images per decode call. ",
    ("vision", "decode_ahead"): "Decoded images an image source reads ahead per lane (rounded up to whole decode "
                                "calls): the memory bound, in place of `doc_buffer` for image sources. ",
    ("vision", "decode_threads"): "Image decode calls at once per process, on threads beside `cpu_threads`' (more "
                                  "than the cores: Pillow holds the GIL for part of each image). ",
    ("vision", "decode_processes"): "With backend \"threads\", worker processes that decode the decode threads' "
                                    "calls out of the GIL (0: the threads decode); the same pixels. Set it to the "
                                    "cores the loader may use. ",
    ("transforms", "map"): '`"pkg.module:function"`: replaces each record with the function\'s result. ',
    ("transforms", "filter"): '`"pkg.module:function"`: keeps the records for which it is true; the others are '
                              "counted per source in statistics. ",
    ("schedule", "step"): "The global step from which `weights` apply. ",
    ("schedule", "weights"): "New weights by source name (relative), e.g. `{ web = 0.3, code = 0.7 }`; 0 "
                             "pauses a source. ",
}

_TABLES: list[tuple[str, str, type[msgspec.Struct]]] = [
    ("", "Top level", Config),
    ("sources", "`[[sources]]` (one per source)", SourceConfig),
    ("vision", "`[vision]`", VisionConfig),
    ("transforms", "`[[sources.transforms]]` (one per step, exactly one key)", TransformStep),
    ("schedule", "`[[schedule]]` (mixture schedule)", ScheduleEntry),
]


def _default(field: Any) -> str:
    if field.required:
        return "required"
    value = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, list) and not value:
        return "none"
    return f"`{msgspec.json.encode(value).decode()}`" if isinstance(value, str) else f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").strip()


def undocumented() -> list[str]:
    """Config fields that have no meaning in MEANINGS."""
    return [f"{table or 'top level'}.{f.name}" for table, _, struct in _TABLES
            for f in msgspec.structs.fields(struct) if (table, f.name) not in MEANINGS]


def config_reference() -> str:
    """The reference as Markdown: one table per config table. *order* keys shape the samples (they
    are in `order_digest`: a checkpoint refuses to load under other values); *exec* keys only
    decide how fast the same samples come."""
    out = []
    for table, title, struct in _TABLES:
        out += [f"**{title}**", "", "| key | default | kind | meaning |", "| --- | --- | --- | --- |"]
        out += [f"| `{f.name}` | {_cell(_default(f))} | {'exec' if (table, f.name) in EXECUTION else 'order'} | "
                f"{_cell(MEANINGS.get((table, f.name), ''))} |" for f in msgspec.structs.fields(struct)]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(config_reference(), end="")
