# Writes strata-train's default corpus: README.md and docs/**/*.md of the source tree (the
# pages in sub-folders too), in the order of their paths as strings, concatenated. Run as:
# cmake -DSRC=<source dir> -DOUT=<file> -P make_corpus.cmake
file(GLOB_RECURSE _docs LIST_DIRECTORIES false "${SRC}/docs/*.md")
list(SORT _docs)
set(_text "")
foreach(_f "${SRC}/README.md" ${_docs})
  file(READ "${_f}" _part)
  string(APPEND _text "${_part}\n")
endforeach()
file(WRITE "${OUT}.tmp" "${_text}")
file(RENAME "${OUT}.tmp" "${OUT}")
