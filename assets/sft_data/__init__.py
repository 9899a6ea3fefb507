"""The pieces of assets/make_data.py's data set: the words it draws from (lexicon.py, glossary.py), English
spelling rules (english.py) and the tasks that turn them into questions with one exact answer (tasks.py,
lexicon_tasks.py)."""
