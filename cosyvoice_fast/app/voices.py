"""The page's saved voices: save the current prompt voice under a name, list them, delete one (through the loaded
service's frontend).  A mixin of :class:`~cosyvoice_fast.app.handlers.Handlers`, which holds ``self.frontend``."""

from __future__ import annotations

from typing import Any

import gradio as gr
import numpy as np

from cosyvoice_fast.app.messages import user_error, user_message


class SavedVoices:
    """Saved-voice buttons; the class that mixes this in sets ``self.frontend`` (None without frontend files)."""

    frontend: Any = None

    def _frontend(self) -> Any:
        if self.frontend is None:
            raise user_error("this model directory has no frontend files, so voices cannot be saved")
        return self.frontend

    def speaker_names(self) -> list[str]:
        return sorted(self.frontend.list_speakers()) if self.frontend is not None else []

    def refresh_speakers(self) -> dict:
        return gr.update(choices=self.speaker_names())

    def save_speaker(self, name: str, upload: str | None, mic: str | None, transcript: str) -> dict:
        fe = self._frontend()
        name = (name or "").strip()
        if not name:
            raise user_error("Type a name for the voice first.")
        path = upload or mic
        if path is None:
            raise user_error("Upload or record the prompt voice to save first.")
        try:
            wav, sr = read_audio(path)
            fe.add_speaker(name, wav, sr, (transcript or "").strip())
        except (ValueError, RuntimeError, OSError) as e:
            raise user_error(user_message(e)) from e
        gr.Info(f"Saved voice '{name}'. Pick the 'saved speaker' mode to use it.")
        return gr.update(choices=self.speaker_names(), value=name)

    def delete_speaker(self, name: str | None) -> dict:
        fe = self._frontend()
        if not name:
            raise user_error("Pick a saved speaker to delete.")
        try:
            fe.delete_speaker(name)
        except (ValueError, KeyError, OSError) as e:
            raise user_error(user_message(e)) from e
        gr.Info(f"Deleted voice '{name}'.")
        return gr.update(choices=self.speaker_names(), value=None)


def read_audio(path: str) -> tuple[np.ndarray, int]:
    """Decode an uploaded or recorded file to mono float32 with the frontend's decoder (soundfile, then the
    system decoder); a file that is not audio, or is empty, is a ``PromptAudioError`` (a ValueError) whose
    message names the file only by its name."""
    from cosyvoice_fast.frontend.audio import load_audio

    # (this used soundfile alone, and its error text, shown to the user, held the upload's absolute path)
    return load_audio(path)
