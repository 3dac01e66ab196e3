// Group commit for outboxd's own writes: the calls of one kind of statement made in the same turn of the
// event loop, or while such a statement is in flight on the pool, are sent together as the next one.
// Nobody waits for anybody's external call, only for the end of the current turn or a statement already
// in flight; n writes made together cost one round trip and one commit instead of n (measured:
// PostgreSQL's cost per statement, not per row, bounds a dispatcher at 0 ms Stripe latency). Each call
// still gets its own answer. A statement the server refused (one poison input, a deadlock) committed
// nothing, so its calls are sent again one by one: each fails or succeeds as it would have alone, and
// one bad input never fails the other calls it happened to travel with.

import pg from 'pg';

/** The most calls one statement carries. */
const MAX_BATCH = 100;

type Run<I, O> = (inputs: I[]) => Promise<O[]>;

interface Waiting<I, O> {
  input: I;
  resolve: (output: O) => void;
  reject: (err: unknown) => void;
}

class Coalescer<I, O> {
  private readonly run: Run<I, O>;
  private waiting: Waiting<I, O>[] = [];
  private sending = false;

  constructor(run: Run<I, O>) {
    this.run = run;
  }

  call(input: I): Promise<O> {
    return new Promise<O>((resolve, reject) => {
      this.waiting.push({ input, resolve, reject });
      // The rest of this turn's calls (a fetched batch's claims) join this one.
      if (!this.sending) setImmediate(() => void this.send());
      this.sending = true;
    });
  }

  private async send(): Promise<void> {
    while (this.waiting.length > 0) {
      const batch = this.waiting.splice(0, MAX_BATCH);
      try {
        await this.answer(batch);
      } catch (err) {
        if (batch.length === 1 || !refusedStatement(err)) for (const w of batch) w.reject(err);
        else await Promise.all(batch.map((w) => this.answer([w]).catch((alone: unknown) => w.reject(alone))));
      }
    }
    this.sending = false;
  }

  private async answer(batch: Waiting<I, O>[]): Promise<void> {
    const outputs = await this.run(batch.map((w) => w.input));
    if (outputs.length !== batch.length) throw new Error(`a coalesced statement answered ${outputs.length} of ${batch.length} calls`);
    batch.forEach((w, i) => w.resolve(outputs[i]!));
  }
}

/** An error the server answered for the statement itself, which then committed nothing. A connection
 * lost, or ended by the server (SQLSTATE class 08, 57P: an administrator, a shutdown; XX: internal),
 * may have followed a commit. By SQLSTATE: the severity's text is in the server's language. */
const refusedStatement = (err: unknown): boolean => err instanceof pg.DatabaseError && !/^(08|57P|XX)/.test(err.code ?? '');

const byTarget = new WeakMap<object, Map<string, Coalescer<never, unknown>>>();

/**
 * The calls of the statement named `key` on `target` (a pool, or a transaction's client: its calls then
 * share its transaction), coalesced: `run` sends the inputs of one batch in one statement and answers
 * each, in order. `key` names everything `run` depends on besides the inputs.
 */
export function coalesced<I, O>(target: object, key: string, run: Run<I, O>): (input: I) => Promise<O> {
  let ofTarget = byTarget.get(target);
  if (!ofTarget) byTarget.set(target, (ofTarget = new Map()));
  let coalescer = ofTarget.get(key) as Coalescer<I, O> | undefined;
  if (!coalescer) ofTarget.set(key, (coalescer = new Coalescer(run)) as unknown as Coalescer<never, unknown>);
  return (input) => coalescer.call(input);
}
