"""The Plan page (placeholder until the planner lands)."""

from __future__ import annotations

import streamlit as st


def render() -> None:
    st.title("Plan")
    st.warning("The mix planner is not available yet.")


if __name__ == "__main__":
    render()
