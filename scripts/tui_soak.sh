#!/usr/bin/env bash
# Soak the chat in tmux: N launches of the real app on the embedded model, each sending a
# question and then cancelling / quitting at random moments (before the model is loaded,
# right after Enter, mid-answer, with a message selected). Counts tracebacks, native
# aborts ("terminate called", exit 134), other non-zero exits and hangs.
#
#   scripts/tui_soak.sh [N]          # N launches (200 by default)
#
# Env: KVCHAT_SOAK_SEED (bash RANDOM seed), KVCHAT_SOAK_SIZE (130x40),
# KVCHAT_SOAK_CMD (the command run in the pane; default: .venv/bin/kvchat chat),
# KVCHAT_SOAK_KEEP=1 keeps the logs. Chats and settings go to a fresh KVCHAT_HOME that
# links the real one's CPU-extension build and converted models (no rebuild per launch).
set -u

N=${1:-200}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CMD=${KVCHAT_SOAK_CMD:-"$ROOT/.venv/bin/kvchat chat"}
SIZE=${KVCHAT_SOAK_SIZE:-130x40}
RANDOM=${KVCHAT_SOAK_SEED:-$$}
SESSION="kvchat-soak-$$"
TMUX_SOCKET="kvchat-soak-$$"  # a server of its own: other tmux sessions are left alone
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvchat-soak.XXXXXX")
REAL_HOME=${KVCHAT_HOME:-$HOME/.cache/kvchat}
export KVCHAT_HOME="$WORK/home"
mkdir -p "$KVCHAT_HOME"
for d in cpu_ext models blas; do
  [ -e "$REAL_HOME/$d" ] && ln -s "$REAL_HOME/$d" "$KVCHAT_HOME/$d"
done
QUESTIONS=("What is the capital of France?" "Write a long story about bread."
           "List ten fruits." "Explain how a bicycle works, step by step.")
PAUSES=(0 0 0.05 0.1 0.3 0.6 1 2 4)

pick() { local a=("$@"); echo "${a[RANDOM % ${#a[@]}]}"; }
tmux() { command tmux -L "$TMUX_SOCKET" "$@"; }
keys() { tmux send-keys -t "$SESSION" "$@" 2>/dev/null; }
alive() { [ ! -e "$1.rc" ]; }
screen() { tmux capture-pane -p -t "$SESSION" 2>/dev/null; }

wait_for_screen() {  # $2 on the screen (max ~60 s); false if the app ended first
  for _ in $(seq 600); do
    screen | grep -q "$2" && return 0
    alive "$1" || return 1
    sleep 0.1
  done
  return 1
}

# one server for the whole soak (else a new session can race the exit of the last one)
tmux new-session -d -s keeper -x 20 -y 5 "sleep 100000"
launches=0 tracebacks=0 aborts=0 nonzero=0 hangs=0
declare -A codes=()
for i in $(seq "$N"); do
  log="$WORK/run-$i"
  tmux kill-session -t "$SESSION" 2>/dev/null
  # the pane's shell outlives a Ctrl+C (trap) so the app's exit status is always kept
  tmux new-session -d -s "$SESSION" -x "${SIZE%x*}" -y "${SIZE#*x}" \
    "trap : INT; $CMD; echo \$? > '$log.rc'; sleep 0.5"
  tmux pipe-pane -o -t "$SESSION" "cat >> '$log.out'"
  launches=$((launches + 1))
  scenario=$((RANDOM % 8))
  # keys go in once the app is up (its footer shows): a Ctrl+C before that is the
  # terminal's SIGINT to a process still importing, not a key the chat can see
  wait_for_screen "$log" "f1 Help"
  if [ $((RANDOM % 4)) -eq 0 ]; then
    sleep "$(pick 0 0.3 1)"  # sometimes before the model is loaded: the question is queued
  else
    wait_for_screen "$log" "KV "  # the status line names the KV format once a model is in
  fi
  [ $((RANDOM % 3)) -eq 0 ] && keys C-n
  keys -l "$(pick "${QUESTIONS[@]}")"
  keys Enter
  sleep "$(pick "${PAUSES[@]}")"
  case $scenario in
    0) keys C-c ;;                                  # cancels (or quits when idle)
    1) keys C-c C-c ;;                              # quits at once
    2) keys Escape; sleep "$(pick "${PAUSES[@]}")"; keys C-c ;;
    3) keys C-q ;;
    4) keys Up; sleep 0.2; keys C-c; sleep 0.3; keys C-q ;;  # copies, then quits
    5) keys C-c; sleep "$(pick 0.1 0.5 1.5)"; keys C-c ;;
    6) keys Enter C-c ;;
    7) sleep "$(pick 1 3)"; keys Escape Escape C-c C-c ;;
  esac
  # whatever the scenario left, quit (Ctrl+Q always quits), then wait for the exit
  for t in $(seq 600); do
    alive "$log" || break
    [ $((t % 30)) -eq 0 ] && keys C-q
    sleep 0.1
  done
  if alive "$log"; then
    hangs=$((hangs + 1))
    echo "run $i: no exit after 60 s (scenario $scenario)"
    tmux kill-session -t "$SESSION" 2>/dev/null
    continue
  fi
  sleep 0.3
  rc=$(cat "$log.rc")
  codes[$rc]=$(( ${codes[$rc]:-0} + 1 ))
  tb=$(grep -c "Traceback" "$log.out" 2>/dev/null)
  ab=$(grep -c "terminate called" "$log.out" 2>/dev/null)
  [ "${tb:-0}" -gt 0 ] && tracebacks=$((tracebacks + 1))
  if [ "${ab:-0}" -gt 0 ] || [ "$rc" = 134 ]; then aborts=$((aborts + 1)); fi
  [ "$rc" != 0 ] && nonzero=$((nonzero + 1))
  if [ "$rc" != 0 ] || [ "${tb:-0}" -gt 0 ] || [ "${ab:-0}" -gt 0 ]; then
    echo "run $i: exit $rc, scenario $scenario, log $log.out"
  fi
done
tmux kill-server 2>/dev/null

summary="launches $launches · tracebacks $tracebacks · aborts $aborts · non-zero exits $nonzero · hangs $hangs · exit codes:"
for c in "${!codes[@]}"; do summary+=" $c×${codes[$c]}"; done
echo "$summary"
if [ "${KVCHAT_SOAK_KEEP:-0}" = 1 ] || [ $((tracebacks + aborts + nonzero + hangs)) -gt 0 ]; then
  echo "logs: $WORK"
else
  rm -rf "$WORK"
fi
[ $((tracebacks + aborts + nonzero + hangs)) -eq 0 ]
