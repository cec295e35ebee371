"""Cost reports over runs and transcripts: recorded usage priced per session, day, model or project
(`report`), the counterfactual of several pipelines (`compare`), and the self-contained HTML
charts (`html_report`)."""
