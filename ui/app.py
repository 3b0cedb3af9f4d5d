"""The mixfleet web app (Streamlit entry script): plan a fleet mix, dry-run it, follow runs.

Started by `mixfleet ui` (ui/commands/webapp.py) as `streamlit run .../mixfleet/ui/app.py`. Three
pages via `st.navigation`, each a script in this package that renders when run as a page:
app_plan.py (the planner), app_dryrun.py (the twin), app_runs.py (run logs). The pages compute
nothing themselves; they call costmodel / policies / twin and chart what those return.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

HERE = Path(__file__).resolve().parent
PAGES = (("app_plan.py", "Plan", "plan", ":material/tune:"),
         ("app_dryrun.py", "Dry-run", "dry-run", ":material/science:"),
         ("app_runs.py", "Runs", "runs", ":material/monitoring:"))


def main() -> None:
    st.set_page_config(page_title="mixfleet", page_icon=":material/hub:", layout="wide")
    pages = [st.Page(str(HERE / f), title=t, url_path=u, icon=i, default=(k == 0))
             for k, (f, t, u, i) in enumerate(PAGES)]
    nav = st.navigation(pages)
    from mixfleet.ui.app_common import keep_inputs

    keep_inputs()               # the pages' inputs outlive a page switch
    st.sidebar.caption("mixfleet: plan, dry-run and run LLM RL on mixed sampler fleets.")
    nav.run()


if __name__ == "__main__":
    main()
