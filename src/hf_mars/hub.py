"""Publishing to the Hugging Face Hub: a MARS checkpoint with its model card, and the Gradio Space that demos it.

`push_to_hub(folder, repo_id)` uploads what a MARS checkpoint needs to load with
`AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True)` and nothing else: safetensors weights (never
pickles: `.bin`/`.pt` files execute code when loaded), the remote code (`decoding.REMOTE_FILES`),
the configs with their MARS defaults, the tokenizer, and a model card rendered from the package's
`templates/model_card.md` (`MODEL_CARD_TEMPLATE`, read through importlib.resources, so it works from a wheel).
Everything goes in one commit, so a repo never holds weights without their card or code.

`push_space(space_id, model_repo)` uploads a Space folder and sets its `MARS_MODEL` variable, which the app reads to
pick the checkpoint. Beside the app goes the part of hf_mars that times pass costs (`SPACE_TIMING`), which the app
runs at its start and a checkpoint's code does not carry. The default folder is the source checkout's `spaces_demo/`,
which is not package data: an installed wheel has none, and `push_space` then asks for `folder=` (`hf-mars
push-space --folder DIR`).

Authentication is huggingface_hub's: `token=None` means the `HF_TOKEN` environment variable, else the token saved
by `hf auth login`. Nothing here reads or overrides a token itself.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData, SpaceCard
from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import filter_repo_objects

from .decoding import REMOTE_FILES
from .tools.measure.tables import markdown_table

logger = logging.getLogger(__name__)

# The Jinja template of every pushed model card: package data (pyproject's package-data), so an installed wheel has it.
MODEL_CARD_TEMPLATE = resources.files(__package__) / "templates" / "model_card.md"
# The Gradio Space: a folder of the source checkout (the repository root's spaces_demo/), not shipped in the wheel.
PROJECT = Path(__file__).resolve().parents[2]
SPACE_FOLDER = PROJECT / "spaces_demo"
TAGS = ["mars", "multi-token-prediction"]
# What a loadable MARS checkpoint consists of. Anything else in the folder (optimizer states, logs, a README of its
# own) stays local and is listed as skipped.
UPLOAD_PATTERNS = [
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    *REMOTE_FILES,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
]
PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


@dataclass
class PushResult:
    """What `push_to_hub` / `push_space` sent: `uploaded` (path, bytes), `skipped` (path, why), the commit."""

    repo_id: str
    repo_type: str
    revision: str
    commit_url: str
    commit_sha: str
    uploaded: list[tuple[str, int]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"Uploaded to {self.repo_type} {self.repo_id} (revision {self.revision}):"]
        lines += [f"  {path:<40} {_human(size):>10}" for path, size in self.uploaded]
        lines.append(f"  {len(self.uploaded)} files, {_human(sum(size for _, size in self.uploaded))}")
        lines += [f"  skipped {path}: {why}" for path, why in self.skipped]
        lines.append(f"Commit: {self.commit_url}")
        return "\n".join(lines)


def _human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000


# -- validation -------------------------------------------------------------------------------------------------


def check_mars_folder(folder: str | Path) -> dict:
    """Check that `folder` is a complete MARS checkpoint saved by hf_mars; return its config.json.

    Raises a ValueError naming what is missing: a folder that fails here would upload fine and then fail on every
    user's machine.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder.")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json: not a saved model.")
    config = json.loads((folder / "config.json").read_text())
    hint = "make it one with hf_mars.to_mars(model, tokenizer) (or hf-mars convert), then save_pretrained()."
    if config.get("mars_mask_token_id") is None:
        raise ValueError(f"{folder} is not a MARS checkpoint (no mars_mask_token_id in config.json): {hint}")
    auto = (config.get("auto_map") or {}).get("AutoModelForCausalLM", "")
    if not auto.startswith("modeling."):
        raise ValueError(
            f"{folder}/config.json has no auto_map entry for AutoModelForCausalLM into modeling.py: {hint}"
        )
    missing = [name for name in REMOTE_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(
            f"{folder} lacks the remote-code files {missing}: trust_remote_code could not load it. {hint}"
        )
    gen = folder / "generation_config.json"
    if not gen.is_file() or "mars_block_size" not in json.loads(gen.read_text()):
        raise ValueError(f"{folder} has no generation_config.json with the MARS defaults (mars_block_size): {hint}")
    _check_weights(folder)
    if not (folder / "tokenizer_config.json").is_file() or not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{folder} has no tokenizer: save it next to the model (tokenizer.save_pretrained(folder)).")
    return config


def _check_weights(folder: Path) -> None:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise ValueError(f"{folder}: model.safetensors.index.json lists shards that are not there: {missing}")
    elif not (folder / "model.safetensors").is_file():
        pickles = sorted(p.name for p in folder.iterdir() if any(p.match(pat) for pat in PICKLE_PATTERNS))
        found = (
            f" (found pickle files {pickles}, which are never uploaded: loading a pickle runs arbitrary code)"
            if pickles
            else ""
        )
        raise ValueError(
            f"{folder} has no safetensors weights{found}. Re-save with model.save_pretrained(folder), which writes "
            "model.safetensors."
        )


# -- the τ table ------------------------------------------------------------------------------------------------


def load_tau_table(tau_table: str | Path | list[dict] | dict | None) -> dict | None:
    """Read and check a measured τ table; return `{"rows": [...], "setup": str | None}` (or None).

    Accepted forms: a list of rows, or `{"setup": "how it was measured", "rows": [...]}`, either as Python objects
    or as a JSON file path. Each row is a dict with at least `tau` (in [0, 1]) and `tokens_per_forward` (> 0, as
    `out.mars_stats.mean_tokens_per_forward` reports it: every forward pass counted, so τ = 1 gives 1); any
    other columns (`accuracy`, `speedup`, `tokens_per_second`, `same_as_ar`, ...) are kept, in order of first
    appearance, and shown as given. Example:

        {"setup": "GSM8K test, 1319 problems, batch 1, one H100",
         "rows": [{"tau": 1.0, "tokens_per_forward": 1.0, "accuracy": 0.712, "speedup": 1.0},
                  {"tau": 0.9, "tokens_per_forward": 1.83, "accuracy": 0.708, "speedup": 1.61}]}
    """
    if tau_table is None:
        return None
    if isinstance(tau_table, (str, Path)):
        try:
            tau_table = json.loads(Path(tau_table).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"Cannot read the τ table {tau_table}: {err}") from err
    setup = None
    if isinstance(tau_table, dict):
        setup, tau_table = tau_table.get("setup"), tau_table.get("rows")
    if not isinstance(tau_table, list) or not tau_table:
        raise ValueError("The τ table must be a non-empty list of rows, or {'setup': ..., 'rows': [...]}.")
    for i, row in enumerate(tau_table):
        if not isinstance(row, dict) or "tau" not in row or "tokens_per_forward" not in row:
            raise ValueError(
                f"τ table row {i} must be a dict with at least 'tau' and 'tokens_per_forward', got {row!r}"
            )
        tau, tpf = row["tau"], row["tokens_per_forward"]
        if not isinstance(tau, (int, float)) or not 0.0 <= tau <= 1.0:
            raise ValueError(f"τ table row {i}: tau must be a number in [0, 1], got {tau!r}")
        if not isinstance(tpf, (int, float)) or not tpf > 0 or math.isinf(tpf):
            raise ValueError(f"τ table row {i}: tokens_per_forward must be a positive number, got {tpf!r}")
    return {"rows": tau_table, "setup": setup}


def tau_table_markdown(table: dict) -> str:
    """A markdown table of the rows, columns in order of first appearance, `tau` first."""
    columns = ["tau"] + [key for key in dict.fromkeys(k for row in table["rows"] for k in row) if key != "tau"]
    names = {"tau": "τ", "tokens_per_forward": "tokens / forward"}

    def cell(column, value):
        if column in ("tau", "tokens_per_forward") and isinstance(value, (int, float)):
            return f"{value:.2f}"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return "" if value is None else str(value)

    head = [names.get(c, c.replace("_", " ")) for c in columns]
    return markdown_table(head, [[cell(c, row.get(c)) for c in columns] for row in table["rows"]])


# -- the model card ---------------------------------------------------------------------------------------------


def _local_card_data(folder: Path):
    """Metadata of a README.md already in the folder (e.g. written by a trainer), or empty card data."""
    readme = folder / "README.md"
    return ModelCard.load(readme).data if readme.is_file() else ModelCardData()


def _base_model_from_config(config: dict, repo_id: str) -> str | None:
    """`_name_or_path` when it names a Hub repo (namespace/name), not a local path and not the target repo."""
    name = config.get("_name_or_path") or ""
    if name.count("/") != 1 or name.startswith((".", "/", "~")) or Path(name).exists() or name == repo_id:
        return None
    return name


def render_model_card(
    folder: str | Path,
    repo_id: str,
    *,
    base_model: str | None = None,
    license: str | None = None,
    datasets: list[str] | None = None,
    tau_table: str | Path | list[dict] | dict | None = None,
    revision: str | None = None,
    template: str | Path | None = None,
) -> ModelCard:
    """The model card for `folder` as it will be published as `repo_id`: Hub metadata plus the Jinja template.

    `base_model`, `license` and `datasets` come from the arguments, else from a README.md already in the folder,
    else (base_model only) from `_name_or_path` in config.json. Unknown values are left out, never guessed.
    """
    folder = Path(folder)
    config = check_mars_folder(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    local = _local_card_data(folder)
    table = load_tau_table(tau_table)
    data = ModelCardData(
        base_model=base_model or getattr(local, "base_model", None) or _base_model_from_config(config, repo_id),
        license=license or getattr(local, "license", None),
        datasets=list(datasets) if datasets else getattr(local, "datasets", None),
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=TAGS,
    )
    template = Path(template) if template is not None else MODEL_CARD_TEMPLATE
    if not template.is_file():
        raise ValueError(f"Model card template {template} not found: pass template= (a Jinja markdown file).")
    return ModelCard.from_template(
        data,
        template_str=template.read_text(encoding="utf-8"),
        repo_id=repo_id,
        revision=revision or "main",
        architecture=config["auto_map"]["AutoModelForCausalLM"].split(".", 1)[1],
        model_type=config.get("model_type"),
        block_size=generation.get("mars_block_size", config.get("mars_block_size")),
        default_tau=generation.get("mars_tau"),
        confidence=generation.get("mars_confidence", "probability"),
        mask_token_id=config["mars_mask_token_id"],
        tau_table=tau_table_markdown(table) if table else None,
        tau_setup=table["setup"] if table else None,
    )


# -- uploads ----------------------------------------------------------------------------------------------------


def select_files(folder: str | Path) -> tuple[list[str], list[tuple[str, str]]]:
    """Split the folder's files into those to upload and those to skip (with the reason), using the patterns above."""
    folder = Path(folder)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    upload = list(filter_repo_objects(files, allow_patterns=UPLOAD_PATTERNS))
    skipped = []
    for path in sorted(set(files) - set(upload)):
        if any(Path(path).match(pattern) for pattern in PICKLE_PATTERNS):
            skipped.append((path, "pickle file: only safetensors weights are uploaded (unpickling runs code)"))
        elif path == "README.md":
            skipped.append((path, "replaced by the generated model card"))
        else:
            skipped.append((path, "not part of a MARS checkpoint"))
    return upload, skipped


def _prepare_repo(
    api: HfApi, repo_id: str, *, repo_type: str, private: bool | None, revision: str | None, token, **create_kwargs
) -> None:
    """Create the repo (or reuse it) and the target branch; refuse to upload into a public repo asked to be private."""
    api.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True, token=token, **create_kwargs)
    if private and not api.repo_info(repo_id, repo_type=repo_type, token=token).private:
        raise ValueError(
            f"{repo_id} already exists and is public; private=True does not change an existing repo's visibility. "
            "Make it private on the Hub (or with HfApi.update_repo_settings) first, or push without --private."
        )
    if revision and revision != "main":
        api.create_branch(repo_id, branch=revision, repo_type=repo_type, exist_ok=True, token=token)


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    base_model: str | None = None,
    license: str | None = None,
    datasets: list[str] | None = None,
    tau_table: str | Path | list[dict] | dict | None = None,
    card_template: str | Path | None = None,
    commit_message: str | None = None,
) -> PushResult:
    """Upload the MARS checkpoint in `folder` to the Hub model repo `repo_id`, with a generated model card.

    Args:
        folder: a MARS checkpoint saved by hf_mars (`to_mars` + `save_pretrained`, or `hf-mars convert`) with its
            tokenizer. Checked first (`check_mars_folder`); nothing is sent if it is incomplete.
        repo_id: "namespace/name" on the Hub. Created if it does not exist.
        token: a Hub token; None (recommended) lets huggingface_hub use `HF_TOKEN` or the saved login.
        private: create the repo private. None: the Hub's default. An existing public repo is refused when True.
        revision: the branch to commit to (created from main if missing); None is main. The card's usage snippet
            pins this revision.
        base_model, license, datasets: Hub metadata; when None, taken from a README.md in the folder, else (base
            model) from `_name_or_path` in config.json; left out when unknown.
        tau_table: measured speed/quality per τ, shown in the card: a JSON file or rows (see `load_tau_table`).
        card_template: a Jinja markdown template instead of the package's `templates/model_card.md`.
        commit_message: defaults to "Upload MARS checkpoint".

    Uploaded: `*.safetensors` (+ index), config.json (as engines read it: `portable_model_config`),
    generation_config.json, the remote code
    (`decoding.REMOTE_FILES`),
    tokenizer files (`tokenizer_config.json` as transformers 4 reads it too: `portable_tokenizer_config`), and
    README.md (the card). Skipped, and listed in the result: pickles (`.bin`, `.pt`, ...), a
    README.md of the folder's own, and anything else. One commit. Returns a `PushResult`; print `.summary()`.
    """
    folder = Path(folder)
    card = render_model_card(
        folder,
        repo_id,
        base_model=base_model,
        license=license,
        datasets=datasets,
        tau_table=tau_table,
        revision=revision,
        template=card_template,
    )
    operations, sizes, skipped = _checkpoint_commit(folder, card)
    api = HfApi(token=token)
    _prepare_repo(api, repo_id, repo_type="model", private=private, revision=revision, token=token)
    info = api.create_commit(
        repo_id, operations, commit_message=commit_message or "Upload MARS checkpoint", revision=revision, token=token
    )
    return PushResult(repo_id, "model", revision or "main", info.commit_url, info.oid, sizes, skipped)


def _checkpoint_commit(
    folder: Path, card: ModelCard
) -> tuple[list[CommitOperationAdd], list[tuple[str, int]], list[tuple[str, str]]]:
    """The one commit of `push_to_hub`: the checkpoint's files (its tokenizer config made portable) and the card as
    README.md; with each file's size as sent, and the files left out (a pickle among them is warned about)."""
    upload, skipped = select_files(folder)
    for path, why in skipped:
        if "pickle" in why:
            logger.warning("Not uploading %s: %s.", path, why)
    card_bytes = str(card).encode()
    portable = {
        "config.json": portable_model_config(folder / "config.json"),
        "tokenizer_config.json": portable_tokenizer_config(folder / "tokenizer_config.json"),
    }
    operations = [CommitOperationAdd(path, portable.get(path) or str(folder / path)) for path in upload]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card_bytes))
    sizes = [(path, len(portable[path]) if portable.get(path) else (folder / path).stat().st_size) for path in upload]
    sizes.append(("README.md", len(card_bytes)))
    return operations, sizes, skipped


def portable_model_config(path: Path) -> bytes | None:
    """`config.json` as serving engines read it, or None when it already is (every folder this hf_mars saves).

    A folder saved by an older hf_mars names `MARS<Base>` in `architectures`, which vLLM and
    SGLang do not know, and has no `mask_token_id`, which vLLM's parallel drafting reads: both are written here.
    """
    config = json.loads(path.read_text())
    names = config.get("architectures") or []
    changed = {}
    if any(name.startswith("MARS") for name in names):
        changed["architectures"] = [name.removeprefix("MARS") for name in names]
    if config.get("mask_token_id") is None and config.get("mars_mask_token_id") is not None:
        changed["mask_token_id"] = config["mars_mask_token_id"]
    return (json.dumps(config | changed, indent=2) + "\n").encode() if changed else None


def portable_tokenizer_config(path: Path) -> bytes | None:
    """`tokenizer_config.json` as transformers 4 also reads it, or None when there is none to change.

    Transformers 5 saves the class as `TokenizersBackend` and the special tokens as an `extra_special_tokens` list;
    4.57 knows neither and cannot load the tokenizer. `PreTrainedTokenizerFast` and `additional_special_tokens` load
    alike in both (same ids, `<|mask|>` a special token), so a checkpoint's code range holds for its tokenizer too.
    """
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    changed = config.get("tokenizer_class") == "TokenizersBackend"
    if changed:
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        extra = config.pop("extra_special_tokens")
        known = config.get("additional_special_tokens") or []
        config["additional_special_tokens"] = known + [t for t in extra if t not in known]
        changed = True
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode() if changed else None


SPACE_IGNORE = ["__pycache__/*", "**/__pycache__/*", "*.pyc", ".*", "**/.*", "*.egg-info/*"]
# The part of hf_mars a Space runs beside its app: timing pass costs, which a checkpoint's code only reads, and what
# that imports. Globs in the package folder, so they hold for a source checkout and an installed wheel alike.
SPACE_TIMING = (
    "__init__.py",
    "decoding/*.py",
    "tools/__init__.py",
    "tools/measure/__init__.py",
    "tools/measure/passes.py",
    "tools/measure/cpu_load.py",
    "tools/measure/dtypes.py",
)


def space_files(folder: Path) -> tuple[list[tuple[str, Path]], list[tuple[str, str]]]:
    """What `push_space` uploads, as (path in the Space, local file): the folder's files, and hf_mars's timing tools
    under `hf_mars/`; and what it leaves out, as (path, why)."""
    own = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    kept = set(filter_repo_objects(own, ignore_patterns=SPACE_IGNORE))
    skipped = [(path, "cache or hidden file") for path in own if path not in kept]
    skipped += [(path, "replaced by this hf_mars's timing tools") for path in own if path.startswith("hf_mars/")]
    package = Path(__file__).resolve().parent
    timing = [p for pattern in SPACE_TIMING for p in sorted(package.glob(pattern))]
    files = [(path, folder / path) for path in own if path in kept and not path.startswith("hf_mars/")]
    return files + [("hf_mars/" + p.relative_to(package).as_posix(), p) for p in timing], skipped


def push_space(
    space_id: str,
    model_repo: str,
    *,
    folder: str | Path | None = None,
    token: str | None = None,
    private: bool | None = None,
    model_revision: str | None = None,
    commit_message: str | None = None,
) -> PushResult:
    """Upload a Gradio Space folder to `space_id` and point it at the MARS checkpoint `model_repo`.

    The Space gets the variable `MARS_MODEL=model_repo` and, when `model_revision` is given, `MARS_REVISION` (pin
    one: the checkpoint's remote code runs in the Space; without it a previous pin is removed). Both are set before
    the upload, so the first build already has them. The folder (default: the source checkout's `spaces_demo/`,
    which an installed wheel does not have) is uploaded as it is, caches and hidden files excepted, in one commit with
    hf_mars's timing tools under `hf_mars/` (`space_files`); its README.md carries the Space's YAML.
    """
    folder = _space_folder(folder)
    api = HfApi(token=token)
    try:  # a typo here would only show as a Space that fails to start
        api.repo_info(model_repo, revision=model_revision, token=token)
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise ValueError(
            f"Model repo {model_repo} (revision {model_revision or 'main'}) not found on the Hub: push it first."
        ) from err
    _prepare_repo(api, space_id, repo_type="space", private=private, revision=None, token=token, space_sdk="gradio")
    _point_space_at(api, space_id, model_repo, model_revision, token)
    files, skipped = space_files(folder)
    info = api.create_commit(
        repo_id=space_id,
        repo_type="space",
        operations=[CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(local)) for path, local in files],
        commit_message=commit_message or f"MARS demo for {model_repo}",
        token=token,
    )
    sizes = [(path, local.stat().st_size) for path, local in files]
    return PushResult(space_id, "space", "main", info.commit_url, info.oid, sizes, skipped)


def _space_folder(folder: str | Path | None) -> Path:
    """The Space folder to upload (default: the source checkout's spaces_demo/), refused unless it holds a Gradio
    app: an upload without one would only show as a Space that fails to build."""
    if folder is None:
        if not (SPACE_FOLDER / "app.py").is_file():
            raise ValueError(
                f"No Space folder given and the default, the source checkout's spaces_demo/ ({SPACE_FOLDER}), is not "
                "there (an installed hf_mars does not ship it): pass folder= (hf-mars push-space --folder DIR), e.g. "
                "the spaces_demo/ folder of the hf_mars repository."
            )
        folder = SPACE_FOLDER
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        raise ValueError(f"{folder} is not a Space folder (missing or empty).")
    readme = folder / "README.md"
    meta = SpaceCard.load(readme).data if readme.is_file() else None
    if meta is not None and meta.sdk not in (None, "gradio"):
        raise ValueError(f"{readme} declares sdk: {meta.sdk}; push_space publishes Gradio Spaces.")
    app_file = (meta.app_file if meta is not None else None) or "app.py"
    if not (folder / app_file).is_file():
        raise ValueError(f"{folder} has no {app_file}: a Gradio Space needs its app file.")
    return folder


def _point_space_at(api: HfApi, space_id: str, model_repo: str, model_revision: str | None, token) -> None:
    """Set the Space's variables that pick its checkpoint: `MARS_MODEL`, and `MARS_REVISION` when a revision is
    pinned (else a previous pin is removed)."""
    api.add_space_variable(
        space_id, "MARS_MODEL", model_repo, description="MARS checkpoint the demo loads", token=token
    )
    if model_revision:
        api.add_space_variable(space_id, "MARS_REVISION", model_revision, token=token)
    elif "MARS_REVISION" in api.get_space_variables(space_id, token=token):  # a stale pin would outlive the model
        api.delete_space_variable(space_id, "MARS_REVISION", token=token)
