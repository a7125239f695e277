"""The app's screens: chat, models, conversations, and small modals."""
