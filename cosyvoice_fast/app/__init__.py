"""The Gradio page: layout, handlers, inputs, the Web Audio player and the dashboard figures."""
