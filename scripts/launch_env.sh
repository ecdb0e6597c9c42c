# Environment for the training processes, sourced by the launch scripts just before they start
# Python:
#   source scripts/launch_env.sh
#
# GLIBC_TUNABLES gains glibc.malloc.tcache_count=0 (unless a tcache_count is already set):
# glibc's per-thread cache of small freed blocks walls in the large blocks torch frees, so under
# ZeRO-3 on CPU the resident set crept up step after step (2.5 GB after 4 steps of a 110M GPT
# at DP=2, with 1.5 GB in use at the peak; with the cache off it levels off at ~1.9 GB, at the
# same speed); zero/host_memory.py has the details. glibc reads it only at process start, hence here; other C libraries ignore it.
case ":${GLIBC_TUNABLES:-}:" in
    *:glibc.malloc.tcache_count=*) ;;
    *) export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.tcache_count=0" ;;
esac
