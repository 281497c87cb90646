# NUTS, a call of its own: $1 is blackjax_nuts or numpyro_nuts.
source .whl-tpu/prelude.sh || exit 3
F='^WARNING: All log|^I0000|hugepages|warnings.warn'
L=$((585 - SECONDS)); echo "$1 at $SECONDS s, limit $L" | tee $OUT/$1.log
timeout $L python3 benchmarks/measure_corpus.py --only $1 --limit $((L - 8)) --budget $((L - 4)) --out $OUT/$1 2>&1 | grep -Ev "$F" | tee -a $OUT/$1.log
echo "done at $SECONDS s" | tee -a $OUT/$1.log
