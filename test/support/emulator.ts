import { StripeEmulator, type EmulatorOptions } from '../../src/emulator/index.ts';
import { StripeGateway, stripeClient, type StripeGatewayOptions } from '../../src/stripe/sdkGateway.ts';

export const TEST_KEY = 'sk_test_outboxd';

export interface RunningEmulator {
  emulator: StripeEmulator;
  url: string;
  gateway(opts?: Partial<StripeGatewayOptions>): StripeGateway;
  client(opts?: Partial<StripeGatewayOptions>): ReturnType<typeof stripeClient>;
  close(): Promise<void>;
}

export async function startEmulator(opts: EmulatorOptions = {}): Promise<RunningEmulator> {
  const emulator = new StripeEmulator(opts);
  const { url } = await emulator.listen(0);
  const base = (o: Partial<StripeGatewayOptions> = {}) => ({ secretKey: TEST_KEY, apiBase: url, timeoutMs: 2_000, ...o });
  return {
    emulator,
    url,
    gateway: (o) => new StripeGateway(base(o)),
    client: (o) => stripeClient(base(o)),
    close: () => emulator.close(),
  };
}
