"""The console's dialogs: the form that collects an admin action's inputs and
the yes/no confirmation every action passes before anything is sent.

Owns layout and keys of those two modal screens; both answer through
dismiss() (form: the parsed values or None; confirm: True/False). Never calls
the daemon.
"""
from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.suggester import SuggestFromList
from textual.widgets import Button, Input, Label, Select, Static

from loraplex.tui.actions import AdminAction, Values, parse

MODAL_CSS = """
ActionForm, Confirm { align: center middle; }
ActionForm > Vertical, Confirm > Vertical {
    width: 64; max-width: 100%; height: auto; max-height: 100%;
    border: thick $accent; background: $surface; padding: 0 1;
}
ActionForm .title, Confirm .title { text-style: bold; width: 100%; }
ActionForm Label { margin-top: 1; }
ActionForm .error { color: $error; height: auto; }
ActionForm Horizontal, Confirm Horizontal { height: auto; align-horizontal: right; margin-top: 1; }
ActionForm Button, Confirm Button { margin-left: 1; min-width: 10; }
"""


class ActionForm(ModalScreen[Values | None]):
    """Inputs of one admin action. Enter on the last input (or OK) submits;
    Escape (or Cancel) dismisses with None. Invalid input is explained in
    place and nothing is returned until it is fixed."""

    DEFAULT_CSS = MODAL_CSS
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, action: AdminAction, adapter_names: Sequence[str] = ()) -> None:
        super().__init__()
        self.action_spec = action
        self.adapter_names = list(adapter_names)

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.action_spec.title, classes="title")
            for f in self.action_spec.fields:
                yield Label(f.label)
                if f.choices:
                    yield Select([(c, c) for c in f.choices], value=f.default or f.choices[0], allow_blank=False,
                                 id=f"field-{f.key}")
                else:
                    suggester = SuggestFromList(self.adapter_names, case_sensitive=True) if f.adapter else None
                    yield Input(value=f.default, placeholder=f.placeholder, suggester=suggester, id=f"field-{f.key}")
            yield Static("", classes="error", id="form-error")
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button("OK", variant="primary", id="ok")

    def raw_values(self) -> dict[str, str]:
        raw: dict[str, str] = {}
        for f in self.action_spec.fields:
            widget = self.query_one(f"#field-{f.key}")
            value = widget.value if isinstance(widget, (Input, Select)) else ""
            raw[f.key] = "" if value is None or value is Select.BLANK else str(value)
        return raw

    def submit(self) -> None:
        try:
            values = parse(self.action_spec, self.raw_values())
        except ValueError as exc:
            self.query_one("#form-error", Static).update(str(exc))
            return
        self.dismiss(values)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        inputs = list(self.query(Input))
        if event.input is inputs[-1]:
            self.submit()
        else:
            self.focus_next()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "ok":
            self.submit()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class Confirm(ModalScreen[bool]):
    """A yes/no question: y / Enter on Yes / click Yes confirm; n / Escape / No decline."""

    DEFAULT_CSS = MODAL_CSS
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n", "answer(False)", "No"),
                Binding("escape", "answer(False)", "No")]

    def __init__(self, question: str, title: str = "Confirm") -> None:
        super().__init__()
        self.question = question
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.title_text, classes="title")
            yield Static(self.question, id="question")
            with Horizontal():
                yield Button("No", id="no")
                yield Button("Yes", variant="warning", id="yes")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # the safe answer is the default

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
