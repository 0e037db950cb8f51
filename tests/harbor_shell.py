"""Shell snippets shared by the Harbor test (Python 3.11) and its scripted agent (3.12)."""

# GET http://pypi.org/ with busybox's nslookup and nc (the static busybox's wget crashes
# without glibc's NSS modules in the image); exit 0 for a 200. The sandbox's DNS answers
# only names its egress rules allow.
FETCH_PYPI = (
    "ip=$(nslookup pypi.org | awk '/^Address/ {a=$NF} END {print a}') && [ -n \"$ip\" ] && "
    "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 \"$ip\" 80 | head -n 1 | grep -q ' 200 '"
)
