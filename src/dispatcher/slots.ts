// A counted set of slots, taken in the order asked for: a replica's calls in flight (WORKER_CONCURRENCY),
// and its claims (twice as many: src/dispatcher/dispatcher.ts), shared by every kind it carries out.
// Jobs fetched beyond the free claims wait here unclaimed, and claimed jobs beyond the free calls wait
// here with their lease.
export class Slots {
  private free: number;
  private readonly waiting: (() => void)[] = [];

  constructor(size: number) {
    this.free = size;
  }

  /** Resolves once a slot is this caller's, with the function that gives it back (once, however often
   * it is called). */
  async take(): Promise<() => void> {
    if (this.free > 0) this.free--;
    else await new Promise<void>((resolve) => this.waiting.push(resolve));
    let held = true;
    return () => {
      if (held) this.release();
      held = false;
    };
  }

  private release(): void {
    const next = this.waiting.shift();
    if (next) next();
    else this.free++;
  }
}
