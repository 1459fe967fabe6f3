"""The open conversation's messages, one scrolling column that follows a reply as it grows
(Textual's anchor: each layout puts the view at the end) until the user scrolls up."""

from __future__ import annotations

from textual.containers import VerticalScroll


class MessageList(VerticalScroll):
    def action_scroll_end(self) -> None:
        """End: the view jumps to the latest line and follows the reply again.

        Textual animates this scroll for a second towards the end as it was when the key
        came, while the anchor puts the view at the end at each layout: the two took turns
        moving the view, and the animation's last step left it short of the text that came
        meanwhile. A reply's tokens lay the screen out only when a line is added, so nothing
        put the view back at the end until the next line."""
        self.scroll_end(animate=False)
