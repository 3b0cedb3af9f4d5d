"""mixfleet.ui: people. The `mixfleet` command line and the Streamlit app; no computation of its own."""
