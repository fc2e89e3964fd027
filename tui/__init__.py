"""loraplex.tui: the Textual admin console (`loraplex top`).

feed (stats subscription and reconnect), history (derived rates), view and
panels (pure renderers), actions (admin operations), modals and help
(dialogs), app (the Textual App). Never imports torch or numpy; only app,
modals, help and panel_widget import Textual.
"""
