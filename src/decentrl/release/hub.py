"""`--push-to-hub REPO`: upload an exported directory with `huggingface_hub`."""

from __future__ import annotations

from pathlib import Path


class PushFailed(RuntimeError):
    """The Hub could not be reached or refused the upload; the message names the fix."""


def push_to_hub(directory: Path, repo_id: str, private: bool = False) -> str:
    """Create `repo_id` if needed and upload `directory`; returns the commit URL."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(directory),
            repo_id=repo_id,
            repo_type="model",
            commit_message="decentrl export",
        )
    except OfflineModeIsEnabled:
        raise PushFailed(
            f"cannot push to {repo_id}: HF_HUB_OFFLINE is set; unset it (the export in {directory} is complete)"
        ) from None
    except HfHubHTTPError as exc:
        raise PushFailed(
            f"the Hub refused the push to {repo_id} ({exc.__class__.__name__}: {str(exc).splitlines()[0]}); "
            "log in with `hf auth login` or set HF_TOKEN"
        ) from None
    except (OSError, httpx.HTTPError) as exc:  # DNS, refused connection, timeouts
        raise PushFailed(
            f"could not reach the Hub to push {repo_id} ({exc.__class__.__name__}); check the network "
            f"(the export in {directory} is complete)"
        ) from None
    return str(commit.commit_url)
