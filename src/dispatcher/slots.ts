// A replica's slots, shared by every kind it carries out: at most `size` operations between their claim
// and the end of their call at once (WORKER_CONCURRENCY), whatever their kind. Jobs fetched beyond the
// free slots wait here, in fetch order, unclaimed.
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
